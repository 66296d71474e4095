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


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_the_region_is_advised_huge_pages_and_faulted_in_at_start():
    """O_DIRECT reads into huge pages go to the disk as requests of up to max_sectors_kb instead of
    ~1 MiB (254 segments of 4 KiB): the arena asks for them, and is resident before any load."""
    mmap = pytest.importorskip("mmap")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("this kernel or Python has no MADV_HUGEPAGE")
    size = 8 << 20
    arena = HostArena(size)
    assert arena.huge_pages is True
    entry = _smaps_entry(arena.take(1).data_ptr())
    assert "hg" in entry["VmFlags"].split()  # madvise(MADV_HUGEPAGE) took
    assert int(entry["Rss"].split()[0]) * 1024 >= size  # every page faulted in by the constructor
    plain = HostArena(size, huge_pages=False)
    assert plain.huge_pages is False and "hg" not in _smaps_entry(plain.take(1).data_ptr())["VmFlags"].split()
