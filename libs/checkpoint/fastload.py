"""Multi-tier pipelined block loader (ServerlessLLM §4): disk -> host -> device.

Reader threads split the requested blocks into chunks and read them with O_DIRECT
(page-aligned offsets, lengths and buffers; plain buffered reads where the
filesystem refuses O_DIRECT), several chunks in flight at once so the disk queue
stays full. Readers only read: post threads checksum each chunk (and copy it to
the device), so CPU work never lowers the number of reads in flight; the block's
CRC is combined from the chunk CRCs.

Where the bytes land depends on the target:
- device is the CPU: straight into the block buffers (page-aligned host memory);
  the host copy *is* the engine's copy, nothing is copied twice.
- device is a GPU, host copy kept (`keep_host=True`, the worker's default): into
  page-locked host block buffers, and the post threads move each finished chunk
  to the device buffer on their own CUDA streams while the readers go on.
- device is a GPU, no host copy: into a fixed pool of page-locked chunks that the
  post threads recycle once their device copy has completed.
`staged=True` forces the chunk-pool path on any device (it is how the copy
logic is tested without a GPU).

With `LoaderConfig(timeline=True)` the job records when each chunk was read and when its copy
ran (`LoadJob.timeline`; CUDA copies timed by events on their stream), which is how the
overlap of copies with the next reads is checked (tests/gpu); off, it costs nothing.

Blocks are announced (callback, `wait`, iteration) in the order they were
requested, each only once all its bytes are on the target and its checksum has
been verified: a block that fails the checksum is never announced, and the job
fails with ChecksumError naming the block and the file.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .crc import crc32_of_pieces
from .format import CheckpointIndex, align_up
from .hostmem import HostArena
from .loader import ChecksumError, read_exactly

IO_ALIGN = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the logical block size
# Defaults from `layercast bench load --sweep` on the dev machine: several readers beat one,
# chunks of 4..16 MiB are alike and larger ones slower; 16 MiB x 4 keeps the syscall count and
# the GPU staging pool small. Run the sweep again on other hardware.
DEFAULT_CHUNK_BYTES = 16 << 20
# Each chunk is read in pieces of this size, so a cancelled job stops reading within one piece
# (the sweep found 4 MiB reads as fast as 16 MiB ones).
READ_PIECE_BYTES = 4 << 20
DEFAULT_THREADS = 4
DEFAULT_POST_THREADS = 2  # crc32 runs at ~3 GB/s per core: two keep ahead of a fast SSD

ReadyCallback = Callable[[int, torch.Tensor], None]


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host buffer whose start is IO_ALIGN-aligned and whose length is rounded up to IO_ALIGN.

    O_DIRECT reads land in it directly; callers use `buf[:nbytes]`. The view keeps the
    over-allocated storage alive.
    """
    capacity = align_up(max(nbytes, 1), IO_ALIGN)
    raw = torch.empty(capacity + IO_ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % IO_ALIGN
    return raw[start : start + capacity]


def host_buffer(arena: HostArena | None, nbytes: int, pin: bool) -> torch.Tensor:
    """From the arena when it has room (no page faults in the reads), else freshly allocated."""
    buf = arena.take(nbytes) if arena is not None else None
    return buf if buf is not None else aligned_empty(nbytes, pin=pin)


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to forget the file's cached pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike) -> float:
    """Share of the file's pages in the page cache now (mincore); 0.0 where it cannot be told."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return 0.0
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return 0.0
            resident = torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum().item()
            return resident / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def open_for_read(path: str | os.PathLike, direct: bool) -> tuple[int, bool]:
    """Open `path`, with O_DIRECT if asked and the filesystem allows it. Returns (fd, direct)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem does not do direct I/O
                raise
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd, False


@dataclass(frozen=True)
class LoaderConfig:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threads: int = DEFAULT_THREADS
    direct: bool = True  # O_DIRECT where the filesystem allows it ...
    # ... unless this share of the file is already in the page cache: then a buffered read
    # copies from memory, faster than reading the disk again.
    cached_threshold: float = 0.9
    verify: bool = True
    staged: bool = False  # force the recycled chunk pool (the no-host-copy GPU path) on any device
    post_threads: int = DEFAULT_POST_THREADS  # checksum + device copy, off the readers' path
    pool_chunks: int = 0  # chunk pool size; 0: threads + 2
    timeline: bool = False  # record each chunk's read and copy spans (LoadJob.timeline)

    def __post_init__(self) -> None:
        if self.chunk_bytes < IO_ALIGN or self.chunk_bytes % IO_ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {IO_ALIGN}, got {self.chunk_bytes}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.post_threads < 1:
            raise ValueError(f"post_threads must be >= 1, got {self.post_threads}")


@dataclass(frozen=True)
class _Chunk:
    block_id: int
    seq: int  # position of the chunk inside its block
    offset_in_block: int
    nbytes: int
    position: int = 0  # position of the chunk in the job (read order when there is one reader)


@dataclass(frozen=True)
class TimelineSpan:
    """One chunk's read or copy, in seconds from the job's start (LoaderConfig.timeline)."""

    kind: str  # "read" (disk -> host) or "copy" (host -> target buffer; on CUDA, as the GPU ran it)
    chunk: int  # the chunk's position in the job
    block_id: int
    start_s: float
    end_s: float


@dataclass
class LoadStats:
    bytes: int = 0
    started: float = 0.0
    block_ready_s: dict[int, float] = field(default_factory=dict)  # seconds from start to announcement
    finished_s: float | None = None
    direct: bool = True  # False when any read went through the page cache (file cached, or no O_DIRECT)
    outside_arena_bytes: int = 0  # host buffers freshly allocated because the arena was full

    @property
    def first_block_s(self) -> float | None:
        return min(self.block_ready_s.values()) if self.block_ready_s else None

    @property
    def gbps(self) -> float:
        return self.bytes / self.finished_s / 1e9 if self.finished_s else 0.0


class LoadJob:
    """One load in flight. Blocks become ready in request order; failures surface on wait/result."""

    def __init__(
        self,
        ckpt_dir: str | os.PathLike,
        index: CheckpointIndex,
        block_ids: Iterable[int],
        device: torch.device,
        config: LoaderConfig,
        keep_host: bool,
        on_ready: ReadyCallback | None,
        pool: ChunkPool | None,
        arena: HostArena | None = None,
    ):
        self.path = Path(ckpt_dir) / index.data_file
        self.index = index
        self.order = list(block_ids)
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"duplicate block ids in {self.order}")
        for b in self.order:
            index.block(b)  # IndexError for a block the checkpoint lacks
        self.device = device
        self.config = config
        self.on_ready = on_ready
        self.stats = LoadStats(bytes=sum(index.block(b).nbytes for b in self.order))

        to_device = device.type != "cpu"
        self._pool = pool if (config.staged or (to_device and not keep_host)) else None
        pin = to_device and torch.cuda.is_available()
        # Host block buffers: the read target unless a chunk pool stages the bytes.
        self.host: dict[int, torch.Tensor] = {}
        if self._pool is None:
            for b in self.order:
                self.host[b] = host_buffer(arena, index.block(b).nbytes, pin)
                if arena is not None and not arena.owns(self.host[b]):
                    self.stats.outside_arena_bytes += index.block(b).nbytes
        # Device block buffers; on the CPU without staging they are the host buffers.
        if to_device or self._pool is not None:
            self.buffers = {b: torch.empty(index.block(b).nbytes, dtype=torch.uint8, device=device) for b in self.order}
        else:
            self.buffers = {b: buf[: index.block(b).nbytes] for b, buf in self.host.items()}
        self._copy_needed = to_device or self._pool is not None

        self._chunks: deque[_Chunk] = deque()
        self._pending: dict[int, int] = {}
        for b in self.order:
            n = index.block(b).nbytes
            starts = range(0, n, config.chunk_bytes)
            self._pending[b] = len(starts)
            for seq, start in enumerate(starts):
                self._chunks.append(_Chunk(b, seq, start, min(config.chunk_bytes, n - start), len(self._chunks)))
        self.timeline: list[TimelineSpan] | None = [] if config.timeline else None
        self._crcs: dict[int, dict[int, tuple[int, int]]] = {b: {} for b in self.order}
        self._complete: set[int] = set()
        self._position = {b: i for i, b in enumerate(self.order)}  # wait() runs per layer while loading
        self._announced = 0  # blocks of self.order announced so far
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._error: BaseException | None = None
        self._to_announce: deque[tuple[int, torch.Tensor]] = deque()
        self._announce_lock = threading.Lock()
        self._post_queue: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []

    # --- public API --------------------------------------------------------------------------
    def start(self) -> LoadJob:
        self.stats.started = time.perf_counter()
        self._direct = self.config.direct and resident_fraction(self.path) < self.config.cached_threshold
        if not self.order:
            self.stats.finished_s = 0.0
            return self
        n_readers = min(self.config.threads, len(self._chunks))
        self._readers_left = n_readers
        for i in range(n_readers):
            self._threads.append(threading.Thread(target=self._reader, name=f"load-read-{i}", daemon=True))
        for i in range(self.config.post_threads):
            self._threads.append(threading.Thread(target=self._post, name=f"load-post-{i}", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def wait(self, block_id: int, timeout: float | None = None) -> torch.Tensor:
        """The block's target buffer once it is announced; raises the job's error if it failed first."""
        if block_id not in self._pending:
            raise KeyError(f"block {block_id} is not part of this load")
        position = self._position[block_id]
        with self._changed:
            if not self._changed.wait_for(lambda: self._announced > position or self._error is not None, timeout):
                raise TimeoutError(f"block {block_id} not ready after {timeout} s")
            if self._announced > position:
                return self.buffers[block_id]
            raise self._error

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for b in self.order:
            yield b, self.wait(b)

    def result(self, timeout: float | None = None) -> dict[int, torch.Tensor]:
        out = {b: self.wait(b, timeout) for b in self.order}
        self.join()
        if self._error is not None:  # e.g. the callback of the last block failed
            raise self._error
        return out

    def done(self) -> bool:
        with self._lock:
            return self._error is not None or self._announced == len(self.order)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        if not self.done():
            self._fail(RuntimeError("load cancelled"))
        self.join()

    def join(self) -> None:
        for t in self._threads:
            t.join()

    # --- threads ----------------------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        with self._changed:
            if self._error is None:
                self._error = error
            self._changed.notify_all()
        if self._pool is not None:
            self._pool.wake_all()

    def _next_chunk(self) -> _Chunk | None:
        with self._lock:
            if self._error is not None or not self._chunks:
                return None
            return self._chunks.popleft()

    def _reader(self) -> None:
        file = _ReaderFile(self.path)
        try:
            file.open(self._direct)
            if not file.direct:
                self.stats.direct = False
            while (chunk := self._next_chunk()) is not None:
                span = align_up(chunk.nbytes, IO_ALIGN)  # may run into the next block's padding or past EOF
                if self._pool is not None:
                    staging = self._pool.take(lambda: self._error is not None)
                    if staging is None:
                        return
                    target = staging[:span]
                else:
                    staging = None
                    target = self.host[chunk.block_id][chunk.offset_in_block : chunk.offset_in_block + span]
                try:
                    read_start = time.perf_counter()
                    self._read_chunk(file, chunk, target)
                    if self.timeline is not None:
                        self._record("read", chunk, read_start, time.perf_counter())
                except BaseException:
                    if staging is not None:
                        self._pool.give(staging)
                    raise
                # Checksum and copy happen on the post threads: this reader goes straight back
                # to the disk, so the number of reads in flight does not drop while CPU work runs.
                self._post_queue.put((chunk, target[: chunk.nbytes], staging))
        except BaseException as e:  # noqa: BLE001 - any reader failure fails the job, never hangs it
            self._fail(e)
        finally:
            file.close()
            with self._lock:
                self._readers_left -= 1
                last = self._readers_left == 0
            if last:
                for _ in range(self.config.post_threads):
                    self._post_queue.put(None)

    def _read_chunk(self, file: _ReaderFile, chunk: _Chunk, target: torch.Tensor) -> None:
        """Read one chunk into `target`."""
        view = memoryview(target.numpy())
        offset = self.index.block(chunk.block_id).offset + chunk.offset_in_block
        what = f"block {chunk.block_id} of {self.path}"
        pieces = dict(piece_bytes=READ_PIECE_BYTES, stop=lambda: self._error is not None)
        try:
            read_exactly(file.fd, view, offset, chunk.nbytes, what, **pieces)
        except OSError as e:
            if not (file.direct and e.errno == errno.EINVAL):
                raise
            # The filesystem took O_DIRECT at open but refuses the read: go buffered.
            file.open(direct=False)
            self.stats.direct = False
            read_exactly(file.fd, view, offset, chunk.nbytes, what, **pieces)

    def _record(self, kind: str, chunk: _Chunk, start: float, end: float) -> None:
        """Append one span (perf_counter times) to the timeline; list.append is atomic."""
        origin = self.stats.started
        self.timeline.append(TimelineSpan(kind, chunk.position, chunk.block_id, start - origin, end - origin))

    def _post(self) -> None:
        """Checksums read chunks and moves them to the device buffers (on CUDA asynchronously,
        on this thread's own stream); a chunk counts as done once its bytes are in place."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(device=self.device) if cuda else None
        in_flight: deque = deque()  # (event, chunk, crc, staging) whose copy may still be running
        timed = self.timeline is not None and cuda and self._copy_needed
        copy_started: dict[int, object] = {}  # chunk position -> its copy's start event (timeline only)
        if timed:
            # GPU times are read as event intervals from a reference event whose host time is known.
            reference = torch.cuda.Event(enable_timing=True)
            reference.record(stream)
            reference.synchronize()
            reference_host = time.perf_counter()

        def retire(block: bool) -> None:
            while in_flight and (block or in_flight[0][0] is None or in_flight[0][0].query()):
                event, chunk, crc, staging = in_flight.popleft()
                if event is not None:
                    event.synchronize()
                    if timed:
                        start = copy_started.pop(chunk.position)
                        self._record("copy", chunk, reference_host + reference.elapsed_time(start) / 1e3,
                                     reference_host + reference.elapsed_time(event) / 1e3)
                if staging is not None:
                    self._pool.give(staging)
                self._chunk_done(chunk, crc)

        try:
            while True:
                try:
                    item = self._post_queue.get(timeout=0.001 if in_flight else None)
                except queue.Empty:
                    retire(block=True)  # nothing new to issue: wait for what is in flight
                    continue
                if item is None:
                    retire(block=True)
                    return
                chunk, src, staging = item
                if self._error is not None:
                    if staging is not None:
                        self._pool.give(staging)
                    continue
                crc = zlib.crc32(memoryview(src.numpy())) if self.config.verify else 0
                event = None
                if self._copy_needed:
                    dst = self.buffers[chunk.block_id][chunk.offset_in_block : chunk.offset_in_block + chunk.nbytes]
                    if cuda:
                        with torch.cuda.stream(stream):
                            if timed:
                                copy_started[chunk.position] = torch.cuda.Event(enable_timing=True)
                                copy_started[chunk.position].record(stream)
                            dst.copy_(src, non_blocking=True)
                            event = torch.cuda.Event(enable_timing=timed)
                            event.record(stream)
                    else:
                        copy_start = time.perf_counter()
                        dst.copy_(src)
                        if self.timeline is not None:
                            self._record("copy", chunk, copy_start, time.perf_counter())
                in_flight.append((event, chunk, crc, staging))
                retire(block=False)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            while in_flight:
                _, _, _, staging = in_flight.popleft()
                if staging is not None:
                    self._pool.give(staging)
            # Readers may still queue chunks until they see the error: give every one back.
            while (item := self._post_queue.get()) is not None:
                if item[2] is not None:
                    self._pool.give(item[2])

    def _verify(self, block_id: int) -> ChecksumError | None:
        """The block's CRC, combined from its chunks' CRCs, against the index (caller holds the lock)."""
        if not self.config.verify:
            return None
        pieces = self._crcs[block_id]
        actual = f"{crc32_of_pieces([pieces[i] for i in range(len(pieces))]):08x}"
        expected = self.index.block(block_id).checksum
        return None if actual == expected else ChecksumError(block_id, self.path, expected, actual)

    def _chunk_done(self, chunk: _Chunk, crc: int) -> None:
        ready: list[tuple[int, torch.Tensor]] = []
        mismatch: ChecksumError | None = None
        with self._changed:
            if self._error is not None:
                return
            self._crcs[chunk.block_id][chunk.seq] = (crc, chunk.nbytes)
            self._pending[chunk.block_id] -= 1
            if self._pending[chunk.block_id] == 0:
                mismatch = self._verify(chunk.block_id)
                if mismatch is None:
                    self._complete.add(chunk.block_id)
            now = time.perf_counter() - self.stats.started
            while self._announced < len(self.order) and self.order[self._announced] in self._complete:
                b = self.order[self._announced]
                self.stats.block_ready_s[b] = now
                ready.append((b, self.buffers[b]))
                self._announced += 1
            if self._announced == len(self.order):
                self.stats.finished_s = now
            if ready:
                self._changed.notify_all()
            if self.on_ready is not None:
                self._to_announce.extend(ready)
        if mismatch is not None:
            # Never marked complete: no block after it in request order can be announced.
            self._fail(mismatch)
            return
        if self.on_ready is None:
            return
        # Callbacks run outside the job's lock (they may call wait/cancel) but one at a time, from
        # one queue, so that they keep request order whichever thread completed the block. A block
        # counted as announced is verified: its callback is delivered even if the job fails later,
        # so callbacks and wait() always agree on which blocks arrived.
        with self._announce_lock:
            while True:
                with self._lock:
                    if not self._to_announce:
                        return
                    b, buf = self._to_announce.popleft()
                try:
                    self.on_ready(b, buf)
                except BaseException as e:  # noqa: BLE001 - a failing consumer fails the load
                    self._fail(e)
                    return


class _ReaderFile:
    """One reader thread's descriptor of the data file; reopening closes the old one first."""

    def __init__(self, path: Path):
        self.path, self.fd, self.direct = path, -1, False

    def open(self, direct: bool) -> None:
        self.close()
        self.fd, self.direct = open_for_read(self.path, direct)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ChunkPool:
    """Fixed set of page-aligned (page-locked with CUDA) staging chunks, reused across jobs."""

    def __init__(self, n_chunks: int, chunk_bytes: int, pin: bool):
        self.chunk_bytes = chunk_bytes
        self._free = [aligned_empty(chunk_bytes, pin=pin) for _ in range(n_chunks)]
        self._cv = threading.Condition()

    def take(self, abandoned: Callable[[], bool]) -> torch.Tensor | None:
        with self._cv:
            while not self._free:
                if abandoned():
                    return None
                self._cv.wait(0.1)
            return self._free.pop()

    def give(self, chunk: torch.Tensor) -> None:
        with self._cv:
            self._free.append(chunk)
            self._cv.notify()

    def wake_all(self) -> None:
        with self._cv:
            self._cv.notify_all()


class BlockLoader:
    """Loads blocks of block checkpoints onto one device; owns the staging chunk pool."""

    def __init__(self, device: str | torch.device = "cpu", config: LoaderConfig | None = None,
                 arena: HostArena | None = None):
        self.device = torch.device(device)
        self.config = config or LoaderConfig()
        self.arena = arena  # reserved, already faulted-in host memory for block buffers (optional)
        self._pool: ChunkPool | None = None
        self._pool_lock = threading.Lock()

    def _chunk_pool(self) -> ChunkPool:
        with self._pool_lock:
            if self._pool is None:
                n = self.config.pool_chunks or self.config.threads + 2
                pin = self.device.type == "cuda" and torch.cuda.is_available()
                self._pool = ChunkPool(n, self.config.chunk_bytes, pin)
            return self._pool

    def start(
        self,
        ckpt_dir: str | os.PathLike,
        index: CheckpointIndex,
        block_ids: Iterable[int] | None = None,
        on_ready: ReadyCallback | None = None,
        keep_host: bool = True,
    ) -> LoadJob:
        """Start loading `block_ids` (all blocks by default, in that order) and return the job."""
        ids = list(range(index.n_blocks) if block_ids is None else block_ids)
        staged = self.config.staged or (self.device.type != "cpu" and not keep_host)
        pool = self._chunk_pool() if staged else None
        return LoadJob(ckpt_dir, index, ids, self.device, self.config, keep_host, on_ready, pool,
                       self.arena).start()

    def load(self, ckpt_dir: str | os.PathLike, index: CheckpointIndex,
             block_ids: Iterable[int] | None = None) -> dict[int, torch.Tensor]:
        return self.start(ckpt_dir, index, block_ids).result()


def copy_to_device(blocks: dict[int, torch.Tensor], device: str | torch.device,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[int, torch.Tensor]:
    """Host tier -> device: copy cached host block buffers into new device buffers.

    On CUDA the copies are chunked and asynchronous on a side stream (page-locked sources
    copy at full PCIe speed); the call returns once every byte has arrived.
    """
    device = torch.device(device)
    out = {b: torch.empty(buf.numel(), dtype=torch.uint8, device=device) for b, buf in blocks.items()}
    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            for b, buf in blocks.items():
                for start in range(0, buf.numel(), chunk_bytes):
                    out[b][start : start + chunk_bytes].copy_(buf[start : start + chunk_bytes], non_blocking=True)
        stream.synchronize()
    else:
        for b, buf in blocks.items():
            out[b].copy_(buf)
    return out
