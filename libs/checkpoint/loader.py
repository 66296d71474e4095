"""Reading blocks: one block region -> one contiguous uint8 buffer, tensors as views over it.

This is the simple, synchronous loader. The multi-tier pipelined loader (O_DIRECT,
reader threads, pinned chunk pool) keeps the same contract: fill a caller-provided
uint8 buffer with exactly the block's bytes and verify its checksum.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from .format import CheckpointIndex, torch_dtype

CHUNK = 16 << 20  # read/checksum granularity; bounds a single read() call and keeps crc32 cache-friendly


class ChecksumError(ValueError):
    def __init__(self, block_id: int, path: str | os.PathLike, expected: str, actual: str):
        self.block_id = block_id
        self.path = str(path)
        self.expected = expected
        self.actual = actual
        super().__init__(f"block {block_id} of {self.path}: checksum mismatch (expected {expected}, got {actual})")


def crc32_hex(buf: memoryview | bytes, chunk: int = CHUNK) -> str:
    mv = memoryview(buf).cast("B")
    crc = 0
    for start in range(0, len(mv), chunk):
        crc = zlib.crc32(mv[start : start + chunk], crc)
    return f"{crc:08x}"


class ReadStopped(Exception):
    """A read gave up between pieces because its caller asked it to stop."""


def read_exactly(fd: int, into: memoryview, offset: int, need: int, what: str, *,
                 piece_bytes: int | None = None, stop: Callable[[], bool] | None = None) -> None:
    """Fill `into` from `offset`; at least `need` bytes must exist (the rest may be past EOF).

    With `piece_bytes`, each read asks for at most that many bytes and `stop()` is checked
    between them (ReadStopped): a cancelled load frees a slow disk within one piece, not one
    whole chunk (16 MiB take 3 s at 40 Mbit/s, and a chunk's pread cannot be interrupted)."""
    got = 0
    while got < len(into):
        if stop is not None and stop():
            raise ReadStopped(f"{what}: read stopped after {got} of {len(into)} bytes")
        end = len(into) if piece_bytes is None else min(len(into), got + piece_bytes)
        n = os.preadv(fd, [into[got:end]], offset + got)
        if n == 0:
            break
        got += n
    if got < need:
        raise ValueError(f"{what}: file truncated ({got} of {need} bytes read at offset {offset})")


def allocate_block(index: CheckpointIndex, block_id: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """An uninitialised buffer of exactly the block's size (what receivers pre-allocate)."""
    return torch.empty(index.block(block_id).nbytes, dtype=torch.uint8, device=device)


def verify_block(index: CheckpointIndex, block_id: int, buffer: torch.Tensor, source: str | os.PathLike = "<memory>") -> None:
    """Raise ChecksumError unless `buffer` (a uint8 tensor) holds exactly the block's bytes."""
    entry = index.block(block_id)
    if buffer.device.type != "cpu":
        buffer = buffer[: entry.nbytes].cpu()
    actual = crc32_hex(buffer[: entry.nbytes].numpy())
    if actual != entry.checksum:
        raise ChecksumError(block_id, source, entry.checksum, actual)


def load_block(
    ckpt_dir: str | os.PathLike,
    index: CheckpointIndex,
    block_id: int,
    out: torch.Tensor | None = None,
    verify: bool = True,
) -> torch.Tensor:
    """Read block `block_id` into `out` (a CPU uint8 tensor of at least the block's size; allocated if None).

    Returns the buffer, exactly `nbytes` long (a view of `out` if `out` was larger).
    Raises ChecksumError if the bytes do not match the index.
    """
    entry = index.block(block_id)
    if out is None:
        out = allocate_block(index, block_id)
    if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("out must be a contiguous CPU uint8 tensor")
    if out.numel() < entry.nbytes:
        raise ValueError(f"out has {out.numel()} bytes, block {block_id} needs {entry.nbytes}")
    buf = out[: entry.nbytes]
    path = Path(ckpt_dir) / index.data_file
    # Read into the tensor's own memory: no intermediate bytes object, no extra copy.
    fd = os.open(path, os.O_RDONLY)
    try:
        read_exactly(fd, memoryview(buf.numpy()), entry.offset, entry.nbytes, f"block {block_id} of {path}")
    finally:
        os.close(fd)
    if verify:
        verify_block(index, block_id, buf, path)
    return buf


def block_tensors(index: CheckpointIndex, block_id: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's tensors as views over `buffer` (any device); no copy is made."""
    entry = index.block(block_id)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < entry.nbytes:
        raise ValueError(f"buffer for block {block_id} must be a 1-D uint8 tensor of at least {entry.nbytes} bytes")
    views = {}
    for t in index.tensors_in_block(block_id):
        raw = buffer[t.offset_in_block : t.offset_in_block + t.nbytes]
        views[t.name] = raw.view(torch_dtype(t.dtype)).view(t.shape)
    return views
