"""libs.checkpoint.fastload: the pipelined multi-tier block loader, and the worker's host-memory tier.

Small checkpoints and tiny chunks (4 KiB - 12 KiB) so that every block spans many chunks
and the chunk, checksum-combining and copier logic is exercised; `staged=True` runs the
chunk-pool + copier path (the GPU no-host-copy path) on the CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch
from safetensors.torch import load_file

from libs.checkpoint import (
    DATA_FILE,
    CheckpointIndex,
    ChecksumError,
    block_tensors,
    convert_checkpoint,
    create_demo_checkpoint,
    load_block,
    verify_block,
)
from libs.checkpoint import fastload
from libs.checkpoint.fastload import (
    DEFAULT_CHUNK_BYTES,
    IO_ALIGN,
    BlockLoader,
    LoaderConfig,
    aligned_empty,
    copy_to_device,
    drop_page_cache,
    open_for_read,
    resident_fraction,
)
from libs.checkpoint import loader as loader_module
from libs.checkpoint.loader import ReadStopped, read_exactly
from libs.engine import Engine, SamplingSpec
from services.worker.host_cache import HostBlockCache

N_BLOCKS = 4  # the tiny preset has 4 layers: one per block
SMALL_CHUNKS = (4096, 3 * 4096)
JOIN_TIMEOUT = 20.0


# -- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp("fastload-hf"), preset="tiny", arch="llama", seed=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, hf) -> Path:
    out = tmp_path_factory.mktemp("fastload-blocks")
    convert_checkpoint(hf, out, N_BLOCKS)
    return out


@pytest.fixture(scope="module")
def index(ckpt) -> CheckpointIndex:
    idx = CheckpointIndex.load(ckpt)
    assert idx.n_blocks == N_BLOCKS
    # Every block spans many of the small chunks.
    assert all(b.nbytes > 10 * max(SMALL_CHUNKS) for b in idx.blocks)
    return idx


@pytest.fixture(scope="module")
def reference(ckpt, index) -> dict[int, torch.Tensor]:
    """The blocks as the simple synchronous loader reads them."""
    return {b.id: load_block(ckpt, index, b.id) for b in index.blocks}


@pytest.fixture(scope="module")
def hf_tensors(hf) -> dict[str, torch.Tensor]:
    return load_file(hf / "model.safetensors")


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def flip_byte(ckpt_dir: Path, offset: int) -> None:
    with open(ckpt_dir / DATA_FILE, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def join(job, timeout: float = JOIN_TIMEOUT) -> None:
    """job.join(), failing the test instead of hanging it."""
    t = threading.Thread(target=job.join, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"load threads still running {timeout} s after the job ended"


_BEFORE: set[threading.Thread] = set()  # threads alive when the current test started


@pytest.fixture(autouse=True)
def _threads_before():
    global _BEFORE
    _BEFORE = set(threading.enumerate())


def loader_threads() -> list[threading.Thread]:
    """Loader threads started by this test that are still running."""
    return [t for t in threading.enumerate() if t.name.startswith("load-") and t.is_alive() and t not in _BEFORE]


SLOW_READ_S = 0.15


def delay_last_chunk(monkeypatch, index: CheckpointIndex, block_id: int) -> None:
    """Make the read of the block's last chunk slow, so that other readers overtake it.

    Without this, chunks are handed out in request order and blocks complete in request
    order too, which would hide announcement-order bugs.
    """
    entry = index.block(block_id)
    real = fastload.read_exactly

    def slow_read(fd, into, offset, need, what, **pieces):
        if offset + need == entry.offset + entry.nbytes:
            time.sleep(SLOW_READ_S)
        return real(fd, into, offset, need, what, **pieces)

    monkeypatch.setattr(fastload, "read_exactly", slow_read)


def assert_same_blocks(got: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], ids) -> None:
    assert list(got) == list(ids)
    for b in ids:
        assert got[b].dtype == torch.uint8 and got[b].dim() == 1
        assert got[b].numel() == reference[b].numel(), b
        assert torch.equal(got[b], reference[b]), f"block {b} differs"


# -- round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize("staged", [False, True], ids=["direct-to-buffer", "staged"])
@pytest.mark.parametrize("chunk_bytes", [*SMALL_CHUNKS, DEFAULT_CHUNK_BYTES], ids=["4k", "12k", "default"])
@pytest.mark.parametrize("threads", [1, 3])
def test_round_trip(ckpt, index, reference, hf_tensors, threads, chunk_bytes, staged):
    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=chunk_bytes, threads=threads, staged=staged))
    job = loader.start(ckpt, index)
    blocks = job.result(timeout=JOIN_TIMEOUT)
    assert_same_blocks(blocks, reference, range(N_BLOCKS))

    seen = set()
    for b, buf in blocks.items():
        verify_block(index, b, buf)
        for name, tensor in block_tensors(index, b, buf).items():
            assert torch.equal(tensor, hf_tensors[name]), name
            seen.add(name)
    assert seen == set(hf_tensors)

    if not staged:
        # The direct CPU path reads straight into page-aligned host buffers (O_DIRECT needs it).
        assert all(buf.data_ptr() % IO_ALIGN == 0 for buf in blocks.values())
        assert all(job.host[b].data_ptr() == blocks[b].data_ptr() for b in blocks)  # no second copy
    assert job.done() and job.error is None
    assert job.stats.bytes == sum(b.nbytes for b in index.blocks)
    assert job.stats.finished_s is not None and job.stats.finished_s >= 0
    assert job.stats.gbps > 0

    # The same loader (and its chunk pool) serves a second load, of a subset in another order.
    again = loader.load(ckpt, index, [2, 0])
    assert_same_blocks(again, reference, [2, 0])
    join(job)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("staged", [False, True])
def test_buffered_reads_give_identical_bytes(ckpt, index, reference, staged, verify):
    config = LoaderConfig(chunk_bytes=4096, threads=2, direct=False, staged=staged, verify=verify)
    job = BlockLoader("cpu", config).start(ckpt, index, [1, 3, 0, 2])
    assert_same_blocks(job.result(timeout=JOIN_TIMEOUT), reference, [1, 3, 0, 2])
    assert job.stats.direct is False


def test_empty_request_and_subsets(ckpt, index, reference):
    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2))
    job = loader.start(ckpt, index, [])
    assert job.result(timeout=1) == {} and job.done() and job.stats.finished_s == 0.0
    for ids in ([3], [0, 3], (b for b in [2, 1])):
        ids = list(ids)
        assert_same_blocks(loader.load(ckpt, index, ids), reference, ids)


def test_after_dropping_page_cache(tmp_path, ckpt, index, reference):
    local = copy_checkpoint(ckpt, tmp_path / "ckpt")
    drop_page_cache(local / DATA_FILE)
    blocks = BlockLoader("cpu", LoaderConfig(chunk_bytes=8192, threads=2)).load(local, index)
    assert_same_blocks(blocks, reference, range(N_BLOCKS))


@pytest.mark.parametrize("nbytes", [0, 1, 63, 4095, 4096, 4097, 3 * 4096 + 5])
def test_aligned_empty(nbytes):
    buf = aligned_empty(nbytes)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
    assert buf.data_ptr() % IO_ALIGN == 0
    assert buf.numel() % IO_ALIGN == 0 and buf.numel() >= max(nbytes, 1)
    buf.fill_(7)  # the whole rounded-up length is writable
    assert int(buf.sum()) == 7 * buf.numel()


# -- checksum failures ------------------------------------------------------------------------


CORRUPTIONS = [  # (request order, corrupted block)
    ([0, 1, 2, 3], 0),
    ([0, 1, 2, 3], 2),
    ([3, 1, 0, 2], 0),
    ([3, 1, 0, 2], 3),
    ([1, 2, 3, 0], 0),
]


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("threads,slow", [(1, False), (3, False), (3, True)], ids=["1", "3", "3-slow"])
@pytest.mark.parametrize("order,bad_block", CORRUPTIONS)
def test_corrupted_block_is_never_announced(tmp_path, monkeypatch, ckpt, index, reference, order, bad_block,
                                            threads, slow, staged):
    bad = copy_checkpoint(ckpt, tmp_path / "bad")
    entry = index.block(bad_block)
    # Alternate between a byte in the middle and the block's very last byte (inside its short tail chunk).
    where = entry.nbytes // 2 if bad_block % 2 == 0 else entry.nbytes - 1
    flip_byte(bad, entry.offset + where)
    path = str(bad / DATA_FILE)
    position = order.index(bad_block)

    announced: list[int] = []
    problems: list[str] = []

    def on_ready(b, buf):
        announced.append(b)
        try:
            verify_block(index, b, buf)
        except ChecksumError as e:  # an announced block must always be intact
            problems.append(str(e))

    if slow:  # the bad block is checked last, after the blocks requested behind it are complete
        delay_last_chunk(monkeypatch, index, bad_block)
    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=threads, staged=staged))
    job = loader.start(bad, index, order, on_ready=on_ready)

    with pytest.raises(ChecksumError) as err:
        job.wait(bad_block, timeout=JOIN_TIMEOUT)
    e = err.value
    assert e.block_id == bad_block and e.path == path
    assert f"block {bad_block}" in str(e) and path in str(e)
    assert e.expected == entry.checksum and e.actual != e.expected
    assert isinstance(e, ValueError)
    for later in order[position:]:
        with pytest.raises(ChecksumError):
            job.wait(later, timeout=JOIN_TIMEOUT)
    with pytest.raises(ChecksumError):
        job.result(timeout=JOIN_TIMEOUT)

    join(job)
    assert not loader_threads()
    assert job.done() and job.error is e
    # Blocks before the bad one (in request order) may have been announced; it and later ones never.
    assert announced == order[: len(announced)] and len(announced) <= position
    assert set(job.stats.block_ready_s) == set(announced)
    assert job.stats.finished_s is None
    assert not problems, problems
    for b in announced:  # an announced block's buffer stays valid after the failure
        assert torch.equal(job.wait(b, timeout=1), reference[b])

    # The same loader still loads the intact checkpoint.
    monkeypatch.undo()
    assert_same_blocks(loader.load(ckpt, index, order), reference, order)


# -- O_DIRECT and its fallback ----------------------------------------------------------------


def test_direct_io_on_a_normal_filesystem(tmp_path, ckpt, index, reference):
    local = copy_checkpoint(ckpt, tmp_path / "ckpt")
    data = local / DATA_FILE
    fd, direct = open_for_read(data, True)
    os.close(fd)
    if not direct:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    for staged in (False, True):
        config = LoaderConfig(chunk_bytes=4096, threads=2, staged=staged)
        drop_page_cache(data)  # a cached file is read through the page cache instead
        if resident_fraction(data) >= config.cached_threshold:
            pytest.skip("the kernel kept the file's pages cached after POSIX_FADV_DONTNEED")
        job = BlockLoader("cpu", config).start(local, index)
        assert_same_blocks(job.result(timeout=JOIN_TIMEOUT), reference, range(N_BLOCKS))
        assert job.stats.direct is True


def test_cached_file_is_read_through_the_page_cache(tmp_path, ckpt, index, reference):
    local = copy_checkpoint(ckpt, tmp_path / "ckpt")
    data = local / DATA_FILE
    data.read_bytes()  # now every page is cached
    assert resident_fraction(data) >= 0.9
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2)).start(local, index)
    assert_same_blocks(job.result(timeout=JOIN_TIMEOUT), reference, range(N_BLOCKS))
    assert job.stats.direct is False
    # A threshold above 1 never counts the file as cached: O_DIRECT wherever the filesystem allows it.
    fd, direct = open_for_read(data, True)
    os.close(fd)
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2, cached_threshold=2.0)).start(local, index)
    assert_same_blocks(job.result(timeout=JOIN_TIMEOUT), reference, range(N_BLOCKS))
    assert job.stats.direct is direct


def test_buffered_when_asked(ckpt, index, reference):
    fd, direct = open_for_read(ckpt / DATA_FILE, False)
    os.close(fd)
    assert direct is False
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=3, direct=False)).start(ckpt, index)
    assert_same_blocks(job.result(timeout=JOIN_TIMEOUT), reference, range(N_BLOCKS))
    assert job.stats.direct is False


@pytest.mark.root
def test_fallback_where_the_filesystem_refuses_direct_io(tmp_path, ckpt, index, reference):
    """ramfs refuses O_DIRECT (EINVAL at open): the loader falls back to buffered reads."""
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.strip()}")
    try:
        local = copy_checkpoint(ckpt, mnt / "ckpt")
        fd, direct = open_for_read(local / DATA_FILE, True)
        os.close(fd)
        if direct:
            pytest.skip("this kernel's ramfs accepts O_DIRECT; nothing to fall back from")
        for staged in (False, True):
            # ramfs pages always count as cached; a threshold above 1 makes the loader try O_DIRECT anyway.
            config = LoaderConfig(chunk_bytes=4096, threads=3, direct=True, staged=staged, cached_threshold=2.0)
            job = BlockLoader("cpu", config).start(local, index, [2, 0, 3, 1])
            assert_same_blocks(job.result(timeout=JOIN_TIMEOUT), reference, [2, 0, 3, 1])
            assert job.stats.direct is False
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# -- readiness order --------------------------------------------------------------------------


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("threads,slow", [(1, False), (4, False), (4, True)], ids=["1", "4", "4-slow"])
@pytest.mark.parametrize("order", [[3, 1, 0, 2], [0, 1, 2, 3], [2, 3]])
def test_blocks_are_announced_in_request_order(monkeypatch, ckpt, index, reference, order, threads, slow, staged):
    announced: list[tuple[int, int]] = []
    callback_times: list[float] = []
    problems: list[str] = []

    def on_ready(b, buf):
        callback_times.append(time.perf_counter())
        announced.append((b, buf.data_ptr()))
        try:  # every byte is in place and checked by the time a block is announced
            verify_block(index, b, buf)
            assert torch.equal(buf, reference[b])
        except Exception as e:  # noqa: BLE001 - reported below, not inside the loader's thread
            problems.append(f"block {b}: {e!r}")

    if slow:  # the first requested block completes last: the others must wait for it
        delay_last_chunk(monkeypatch, index, order[0])
    # With one reader, one post thread too: chunks then complete strictly in request order.
    config = LoaderConfig(chunk_bytes=4096, threads=threads, staged=staged, post_threads=1 if threads == 1 else 2)
    job = BlockLoader("cpu", config).start(ckpt, index, order, on_ready=on_ready)
    iterated = [(b, buf.data_ptr()) for b, buf in job]
    join(job)

    assert not problems, problems
    assert [b for b, _ in announced] == order
    assert iterated == announced  # same order, same buffers
    ready = job.stats.block_ready_s
    assert list(ready) == order and set(ready) == set(order)
    times = [ready[b] for b in order]
    assert times == sorted(times)
    assert job.stats.first_block_s == times[0]
    assert times[0] <= job.stats.finished_s == times[-1]
    if slow:
        assert times[0] >= SLOW_READ_S
    if threads == 1 and len(order) > 1:
        # One reader and one post thread work through the chunks in request order: the first block is announced
        # (and its callback has run) well before the last chunk is read.
        assert times[0] < times[-1]
        assert callback_times[0] < job.stats.started + job.stats.finished_s


# -- host-memory tier -------------------------------------------------------------------------


def buf(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_host_cache_evicts_least_recently_used():
    cache = HostBlockCache(capacity_bytes=300)
    assert cache.put(("m", 0), buf(100)) == []
    assert cache.put(("m", 1), buf(100)) == []
    assert cache.put(("m", 2), buf(100)) == []
    assert cache.used_bytes == 300
    assert cache.get(("m", 0)) is not None  # refreshes block 0: block 1 is now the oldest
    assert cache.put(("n", 0), buf(100)) == [("m", 1)]
    assert cache.keys() == [("m", 2), ("m", 0), ("n", 0)]
    assert ("m", 1) not in cache and cache.get(("m", 1)) is None
    # A big block pushes out as many old ones as needed, oldest first.
    assert cache.put(("n", 1), buf(250)) == [("m", 2), ("m", 0), ("n", 0)]
    assert cache.keys() == [("n", 1)] and cache.used_bytes == 250
    # Replacing a key does not count it twice.
    assert cache.put(("n", 1), buf(300)) == [] and cache.used_bytes == 300


def test_host_cache_never_evicts_pinned_blocks():
    cache = HostBlockCache(capacity_bytes=200)
    cache.pin(("m", 0))
    cache.pin(("m", 1))
    assert cache.put(("m", 0), buf(100)) == []
    assert cache.put(("m", 1), buf(100)) == []
    assert cache.put(("m", 2), buf(100)) == [("m", 2)]  # only the unpinned block can go
    cache.pin(("m", 3))
    assert cache.put(("m", 3), buf(100)) == []  # over capacity, but everything is pinned
    assert cache.used_bytes == 300 > cache.capacity_bytes
    assert cache.keys() == [("m", 0), ("m", 1), ("m", 3)]
    assert all(cache.pinned(k) for k in cache.keys())

    # Nested pins need as many unpins.
    cache.pin(("m", 0))
    assert cache.unpin(("m", 0)) == [] and cache.pinned(("m", 0))
    # The last unpin makes it evictable; it is the least recently used, so it goes at once.
    assert cache.unpin(("m", 0)) == [("m", 0)]
    assert not cache.pinned(("m", 0)) and cache.used_bytes == 200
    # Back under capacity: unpinning evicts nothing more.
    assert cache.unpin(("m", 1)) == []
    assert cache.keys() == [("m", 1), ("m", 3)]
    # Once unpinned, a block is evicted like any other.
    assert cache.put(("m", 4), buf(100)) == [("m", 1)]


def test_host_cache_keeps_at_most_max_models_least_recently_used_out_first():
    cache = HostBlockCache(capacity_bytes=10_000, max_models=2)
    assert cache.put(("a", 0), buf(10)) == [] and cache.put(("a", 1), buf(10)) == []
    assert cache.put(("b", 0), buf(10)) == []
    cache.get(("a", 0))  # a is now the most recently used model
    assert cache.models() == ["b", "a"]
    # A third model pushes out every block of the least recently used one, with room to spare in bytes.
    assert cache.put(("c", 0), buf(10)) == [("b", 0)]
    assert cache.models() == ["a", "c"] and cache.used_bytes == 30
    # A model with a pinned block stays (it is in use) and counts: the next oldest goes instead.
    cache.pin(("a", 1))
    assert cache.put(("d", 0), buf(10)) == [("c", 0)]
    assert cache.models() == ["a", "d"]
    # Unpinned, a is the least recently used and goes on the next overflow.
    assert cache.unpin(("a", 1)) == []
    assert cache.put(("e", 0), buf(10)) == [("a", 1), ("a", 0)]
    assert cache.models() == ["d", "e"]
    with pytest.raises(ValueError):
        HostBlockCache(capacity_bytes=10, max_models=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("put get pin unpin".split()), st.integers(0, 4), st.integers(0, 2)),
                max_size=40), st.integers(1, 3))
@example([("put", 0, 0), ("pin", 0, 0), ("pin", 1, 0), ("put", 1, 1)], 1)  # m1 pinned before its block came
def test_host_cache_model_bound_holds_unless_pinned_models_exceed_it(ops, max_models):
    cache = HostBlockCache(capacity_bytes=1 << 20, max_models=max_models)
    pins: dict[tuple[str, int], int] = {}
    for op, model, block in ops:
        key = (f"m{model}", block)
        held = {k for k, n in pins.items() if n and k in cache}
        if op == "put":
            cache.put(key, buf(8))
        elif op == "get":
            cache.get(key)
        elif op == "pin":
            cache.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif pins.get(key):
            cache.unpin(key)
            pins[key] -= 1
        # A pin counts even before its block arrives (a load pins first): that model is in use.
        pinned_models = {k[0] for k, n in pins.items() if n}
        assert len(cache.models()) <= max(max_models, len(pinned_models))
        assert all(k in cache for k in held if pins[k])  # a pinned block is never evicted


def test_host_cache_holds_loaded_blocks(ckpt, index, reference):
    """The worker's flow: loaded host buffers go into the cache; a refreshed block outlives older ones."""
    blocks = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2)).load(ckpt, index)
    size = {b: t.numel() for b, t in blocks.items()}
    cache = HostBlockCache(capacity_bytes=size[0] + size[1] + size[2])
    for b in (0, 1, 2):
        assert cache.put(("tiny", b), blocks[b]) == []
    assert cache.used_bytes == cache.capacity_bytes
    cache.get(("tiny", 0))  # recency now 1, 2, 0
    # Block 3 needs the room of the oldest blocks: they go, oldest first, until it fits; 0 stays.
    evicted = cache.put(("tiny", 3), blocks[3])
    assert evicted and evicted == [("tiny", b) for b in (1, 2)][: len(evicted)]
    assert cache.keys() == [k for k in [("tiny", 1), ("tiny", 2), ("tiny", 0), ("tiny", 3)] if k not in evicted]
    assert cache.used_bytes <= cache.capacity_bytes
    assert torch.equal(cache.get(("tiny", 0)), reference[0])
    assert torch.equal(cache.get(("tiny", 3)), reference[3])


# -- loading while serving --------------------------------------------------------------------


PROMPTS = [[1, 17, 200, 45, 301, 99, 7, 450, 12, 64], [1, 2, 3], [1, 400, 401, 402, 5, 6]]


def generate(engine: Engine, tag: str) -> dict[int, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", p, SamplingSpec(temperature=0, max_tokens=12))
    out: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    for _ in range(1000):
        if not engine.has_work():
            return out
        for o in engine.step():
            out[int(o.request_id.rsplit("-", 1)[1])].append(o.token_id)
    raise AssertionError("engine did not finish")


def test_loading_while_serving(tmp_path, ckpt, index, reference):
    other = copy_checkpoint(ckpt, tmp_path / "copy")
    engine = Engine(index, BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2)).load(ckpt, index),
                    max_batch_size=8, max_seq_len=256)
    want = generate(engine, "ref")
    assert all(len(t) > 0 for t in want.values())

    errors: list[BaseException] = []
    loads_done = threading.Event()
    served: list[dict[int, list[int]]] = []
    loaded = 0

    def load_repeatedly():
        nonlocal loaded
        try:
            loaders = [
                BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2)),
                BlockLoader("cpu", LoaderConfig(chunk_bytes=3 * 4096, threads=3, staged=True)),
            ]
            for i in range(6):
                src = (ckpt, other)[i % 2]
                order = [3, 1, 0, 2] if i % 3 else list(range(N_BLOCKS))
                blocks = loaders[i // 2 % 2].start(src, index, order).result(timeout=JOIN_TIMEOUT)
                for b, t in blocks.items():
                    verify_block(index, b, t)
                    assert torch.equal(t, reference[b])
                loaded += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            loads_done.set()

    def serve():
        try:
            round_ = 0
            while not loads_done.is_set() or round_ < 2:
                served.append(generate(engine, f"r{round_}"))
                round_ += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load_repeatedly), threading.Thread(target=serve)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "serving or loading hung"
    assert not errors, errors
    assert loaded == 6 and len(served) >= 2
    for tokens in served:
        assert tokens == want


# -- bad input and failures -------------------------------------------------------------------


def test_bad_requests(ckpt, index):
    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096))
    with pytest.raises(ValueError, match="duplicate"):
        loader.start(ckpt, index, [0, 1, 0])
    with pytest.raises(IndexError):
        loader.start(ckpt, index, [0, N_BLOCKS])
    with pytest.raises(IndexError):
        loader.start(ckpt, index, [-1])
    assert not loader_threads()  # a rejected request starts no thread
    job = loader.start(ckpt, index, [1])
    with pytest.raises(KeyError):
        job.wait(0)
    job.result(timeout=JOIN_TIMEOUT)


@pytest.mark.parametrize(
    "kwargs", [dict(chunk_bytes=1000), dict(chunk_bytes=0), dict(chunk_bytes=4097), dict(chunk_bytes=-4096),
               dict(threads=0), dict(threads=-1)],
)
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        LoaderConfig(**kwargs)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("cut", ["mid-block-2", "block-boundary", "empty"])
def test_truncated_file_fails_the_job(tmp_path, ckpt, index, reference, cut, threads, staged):
    bad = copy_checkpoint(ckpt, tmp_path / "bad")
    size = {"mid-block-2": index.block(2).offset + index.block(2).nbytes // 2 + 123,
            "block-boundary": index.block(3).offset, "empty": 0}[cut]
    os.truncate(bad / DATA_FILE, size)
    first_missing = 2 if cut == "mid-block-2" else 3 if cut == "block-boundary" else 0
    announced = []
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=threads, staged=staged)).start(
        bad, index, on_ready=lambda b, _: announced.append(b))
    with pytest.raises(ValueError, match="truncated") as err:
        job.result(timeout=JOIN_TIMEOUT)
    assert not isinstance(err.value, ChecksumError)
    assert str(bad / DATA_FILE) in str(err.value)
    join(job)
    assert not loader_threads()
    assert job.error is err.value and job.done()
    assert announced == list(range(len(announced))) and len(announced) <= first_missing
    for b in announced:
        assert torch.equal(job.wait(b, timeout=1), reference[b])


def test_staged_loader_survives_failed_jobs(tmp_path, ckpt, index, reference):
    bad = copy_checkpoint(ckpt, tmp_path / "bad")
    os.truncate(bad / DATA_FILE, index.block(1).offset + 5000)
    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2, staged=True))  # pool of 4 chunks
    try:
        for _ in range(6):
            job = loader.start(bad, index)
            with pytest.raises(ValueError, match="truncated"):
                job.result(timeout=1)
            join(job)
        job = loader.start(ckpt, index)
        assert_same_blocks(job.result(timeout=1), reference, range(N_BLOCKS))  # takes milliseconds
    finally:
        job.cancel()  # frees readers stuck waiting for a staging chunk


@pytest.mark.parametrize("staged", [False, True])
def test_raising_callback_fails_the_job(ckpt, index, reference, staged):
    def refuse(b, _):
        raise KeyError(f"callback refused block {b}")

    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=3, staged=staged))
    timeout = 1 if staged else JOIN_TIMEOUT  # a load takes milliseconds; a leaked staging chunk would hang
    job = None
    try:
        for _ in range(4):
            job = loader.start(ckpt, index, on_ready=refuse)
            with pytest.raises(KeyError):
                job.result(timeout=timeout)
            join(job)
            assert not loader_threads()
            assert isinstance(job.error, KeyError) and "refused" in str(job.error) and job.done()
        job = loader.start(ckpt, index)
        assert_same_blocks(job.result(timeout=timeout), reference, range(N_BLOCKS))  # the loader still works
    finally:
        if job is not None:
            job.cancel()


def test_result_raises_when_the_last_callback_fails(ckpt, index):
    def refuse_last(b, _):
        if b == N_BLOCKS - 1:
            raise KeyError("callback refused the last block")

    # One reader: blocks complete, and are announced, one at a time in request order.
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=1)).start(ckpt, index, on_ready=refuse_last)
    join(job)
    assert isinstance(job.error, KeyError) and job.done()
    with pytest.raises(KeyError, match="refused"):
        job.result(timeout=JOIN_TIMEOUT)


def test_missing_data_file(tmp_path, ckpt, index):
    """No blocks.bin: FileNotFoundError, from start() or from the job, and no hang."""
    broken = copy_checkpoint(ckpt, tmp_path / "broken")
    (broken / DATA_FILE).unlink()
    for direct in (True, False):
        with pytest.raises(FileNotFoundError):
            job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2, direct=direct)).start(broken, index)
            try:
                job.result(timeout=JOIN_TIMEOUT)
            finally:
                join(job)
    assert not loader_threads()


def test_a_read_in_pieces_fills_the_same_bytes_and_stops_between_pieces(tmp_path):
    data = os.urandom(10 * 4096 + 123)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        whole = bytearray(len(data))
        read_exactly(fd, memoryview(whole), 0, len(data), "f", piece_bytes=4096, stop=lambda: False)
        assert whole == data
        asked = []
        part = bytearray(len(data))
        with pytest.raises(ReadStopped, match="after 12288 of"):
            read_exactly(fd, memoryview(part), 0, len(data), "f", piece_bytes=4096,
                         stop=lambda: asked.append(1) or len(asked) > 3)
        assert part[:12288] == data[:12288] and not any(part[12288:])
    finally:
        os.close(fd)


def test_a_cancelled_job_stops_reading_within_one_piece_per_reader(monkeypatch, ckpt, index):
    """A chunk's reads come in pieces: cancel() does not wait for whole chunks (on a throttled
    disk a 16 MiB chunk takes seconds) but for at most the piece each reader is in."""
    monkeypatch.setattr(fastload, "READ_PIECE_BYTES", 4096)
    real, calls, jobs = os.preadv, [], []

    def slow_preadv(fd, buffers, offset):
        # (did this read start after the cancel, how much does it read)
        calls.append((bool(jobs) and jobs[0].error is not None, sum(len(b) for b in buffers)))
        time.sleep(0.002)  # a slow disk: the readers are mid-chunk when cancel() comes
        return real(fd, buffers, offset)

    monkeypatch.setattr(loader_module.os, "preadv", slow_preadv)
    threads = 2
    jobs.append(BlockLoader("cpu", LoaderConfig(chunk_bytes=64 * 4096, threads=threads, staged=False))
                .start(ckpt, index))
    wait_until = time.monotonic() + JOIN_TIMEOUT
    while len(calls) < 5 and time.monotonic() < wait_until:
        time.sleep(0.001)
    jobs[0].cancel()
    assert jobs[0].done() and isinstance(jobs[0].error, RuntimeError) and "cancel" in str(jobs[0].error)
    # Each reader checks before every piece: at most one read per reader can start after the cancel
    # (between its check and its read), where whole chunks would be 64 reads each.
    assert sum(after for after, _ in calls) <= threads and len(calls) < index.total_nbytes // 4096
    assert max(n for _, n in calls) == 4096  # so a cancel waits for 4 KiB per reader, not a 256 KiB chunk
    assert not loader_threads()


def test_cancel_a_running_job(ckpt, index, reference):
    """cancel() while a block is being announced: it returns, the job fails, its threads end."""
    entered, release = threading.Event(), threading.Event()
    announced = []

    def on_ready(b, _):
        announced.append(b)
        if len(announced) == 1:
            entered.set()
            release.wait(JOIN_TIMEOUT)  # hold the job mid-way until cancel() is under way

    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=1)).start(ckpt, index, on_ready=on_ready)
    assert entered.wait(JOIN_TIMEOUT)
    canceller = threading.Thread(target=job.cancel, daemon=True)
    canceller.start()
    time.sleep(0.05)
    release.set()
    canceller.join(JOIN_TIMEOUT)
    assert not canceller.is_alive(), "cancel() did not return"
    # Callbacks run outside the job's lock, so the readers may finish every block while the first
    # callback is held: then the load completed before cancel() and cancel() leaves it complete.
    completed = job.error is None
    assert completed or (isinstance(job.error, RuntimeError) and "cancel" in str(job.error))
    if completed:
        assert announced == list(range(N_BLOCKS)) and job.stats.finished_s is not None
    assert job.done() and not loader_threads()
    assert announced == list(range(len(announced)))
    # The reader may still finish a few chunks between the callback's return and cancel() taking
    # the job's lock (rarely, all of them); blocks announced by then stay valid, the rest never come.
    if len(announced) < N_BLOCKS:
        assert job.stats.finished_s is None
        with pytest.raises(RuntimeError, match="cancel"):
            job.result(timeout=1)
        with pytest.raises(RuntimeError, match="cancel"):
            job.wait(N_BLOCKS - 1, timeout=1)
    for b in announced:
        assert torch.equal(job.wait(b, timeout=1), reference[b])


@pytest.mark.parametrize("staged", [False, True])
def test_cancel_is_safe_at_any_time(ckpt, index, staged):
    loader = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=3, staged=staged))
    for _ in range(5):
        job = loader.start(ckpt, index)
        job.cancel()  # right away, mid-way or after the end: returns; a finished job stays finished
        assert job.done() and (job.error is not None) != (job.stats.finished_s is not None)
    assert not loader_threads()
    assert len(loader.load(ckpt, index)) == N_BLOCKS  # the pool is intact afterwards


# -- host tier -> device ----------------------------------------------------------------------


def test_copy_to_device_cpu(ckpt, index, reference):
    blocks = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2)).load(ckpt, index, [2, 0])
    copies = copy_to_device(blocks, "cpu")
    assert list(copies) == [2, 0]
    for b, t in copies.items():
        assert t.device.type == "cpu" and t.dtype == torch.uint8
        assert t.data_ptr() != blocks[b].data_ptr()
        assert torch.equal(t, blocks[b]) and torch.equal(t, reference[b])
    blocks[2].zero_()  # the copies are independent of the originals
    assert torch.equal(copies[2], reference[2])
    assert copy_to_device({}, "cpu") == {}
