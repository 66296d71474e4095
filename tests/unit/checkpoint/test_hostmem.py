"""HostArena: reserved host memory carved into page-aligned block buffers, returned by the GC."""

import gc

import pytest
import torch

from libs.checkpoint.hostmem import ARENA_ALIGN, HostArena


def test_buffers_are_aligned_disjoint_and_the_arena_fills_up():
    arena = HostArena(5 * ARENA_ALIGN)
    a, b = arena.take(1), arena.take(2 * ARENA_ALIGN)
    assert a.numel() == ARENA_ALIGN and b.numel() == 2 * ARENA_ALIGN
    assert a.data_ptr() % ARENA_ALIGN == 0 and b.data_ptr() % ARENA_ALIGN == 0
    a.fill_(1)
    b.fill_(2)
    assert int(a.sum()) == ARENA_ALIGN  # writing b did not touch a
    assert arena.take(3 * ARENA_ALIGN) is None  # only 2 pages left
    assert arena.free_bytes == 2 * ARENA_ALIGN


def test_memory_returns_only_when_the_last_view_is_gone_and_free_extents_coalesce():
    arena = HostArena(4 * ARENA_ALIGN)
    bufs = [arena.take(ARENA_ALIGN) for _ in range(4)]
    view = bufs[1][10:20]  # an engine's parameter view, say
    del bufs[1]
    gc.collect()
    assert arena.free_bytes == 0  # the view still holds page 1
    del view, bufs[0]  # pages 0 and 1 are now both unreferenced
    gc.collect()
    assert arena.free_bytes == 2 * ARENA_ALIGN
    big = arena.take(2 * ARENA_ALIGN)  # needs pages 0 and 1 merged into one extent
    assert big is not None
    del bufs[:], big
    gc.collect()
    whole = arena.take(4 * ARENA_ALIGN)
    assert whole is not None and whole.numel() == 4 * ARENA_ALIGN


def test_reused_memory_is_never_shared_with_a_live_buffer():
    arena = HostArena(64 * ARENA_ALIGN)
    live = []
    for i in range(200):
        buf = arena.take((i % 7 + 1) * 1000)
        if buf is None:
            live.pop(0)
            gc.collect()
            continue
        buf.fill_(i % 251)
        live.append((i % 251, buf))
        if len(live) > 8:
            live.pop(0)
    for value, buf in live:
        assert bool((buf == value).all())


def test_bad_capacity():
    with pytest.raises(ValueError):
        HostArena(0)


def test_loader_uses_the_arena_and_falls_back_when_full(tiny_checkpoint):
    from libs.checkpoint import CheckpointIndex, load_block
    from libs.checkpoint.fastload import BlockLoader, LoaderConfig

    index = CheckpointIndex.load(tiny_checkpoint)
    arena = HostArena(index.block(0).nbytes)  # room for the first block only
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2), arena=arena).start(tiny_checkpoint, index)
    blocks = job.result()
    base, end = arena._base.data_ptr(), arena._base.data_ptr() + arena.capacity_bytes
    assert base <= blocks[0].data_ptr() < end  # from the arena
    assert not base <= blocks[1].data_ptr() < end  # fresh memory: the arena was full
    for b, buf in blocks.items():
        assert torch.equal(buf, load_block(tiny_checkpoint, index, b))
