"""Host memory reserved up front for block buffers (ServerlessLLM's pinned memory pool).

A cold load into freshly allocated memory pays for a page fault per 4 KiB page inside
every read, as much CPU as the checksums on a small machine.
An arena maps and faults its whole region once, when the worker starts (page-locked when
a GPU is present), and carves block buffers out of it.

The region asks for transparent huge pages (madvise MADV_HUGEPAGE, where the kernel offers
them): an O_DIRECT read is split into block requests of at most max_segments (often ~254)
physically contiguous segments, so into 4 KiB pages a read goes to the disk as ~1 MiB
requests, into 2 MiB pages as requests up to the queue's max_sectors_kb. On the dev VM's
virtio disk that took raw O_DIRECT reads (4 x 16 MiB readers) from 0.36-0.51 to 0.77-1.73
GB/s; runai-model-streamer (io_uring, registered buffers) had read that disk at up to 0.87 GB/s,
above the 4 KiB-page bound (`bench load`'s peers).

A buffer goes back to the arena on its own when the last tensor viewing it is gone: each
is a torch view of a numpy slice that carries a finalizer, so memory still referenced by
an engine, a cache or a load can never be handed out twice.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref
from collections import deque

import torch

from .format import align_up

ARENA_ALIGN = 4096  # O_DIRECT and RDMA registration both want page-aligned buffers


def _advise_huge_pages(region: mmap.mmap) -> bool:
    """madvise(MADV_HUGEPAGE) on the region; False where the kernel or Python lacks it."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        region.madvise(advice)
    except OSError:  # e.g. THP compiled out
        return False
    return True


class HostArena:
    def __init__(self, capacity_bytes: int, pin: bool = False, huge_pages: bool = True):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = align_up(capacity_bytes, ARENA_ALIGN)
        self.huge_pages = False  # whether the region was advised to use transparent huge pages
        if pin:
            # cudaHostAlloc memory is resident from the start.
            self._base = torch.empty(self.capacity_bytes, dtype=torch.uint8, pin_memory=True)
        else:
            self._mmap = mmap.mmap(-1, self.capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.huge_pages = _advise_huge_pages(self._mmap) if huge_pages else False
            self._base = torch.frombuffer(self._mmap, dtype=torch.uint8)
            self._base.zero_()  # fault the region in now (after the advice, so with huge pages)
        self._array = self._base.numpy()
        self._free: list[tuple[int, int]] = [(0, self.capacity_bytes)]  # (offset, size), sorted, coalesced
        # Finalizers may run on any thread, even inside take() during a GC: they only append here.
        self._released: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A page-aligned uint8 buffer of align_up(nbytes, 4096) bytes, or None when the arena is full."""
        size = align_up(max(nbytes, 1), ARENA_ALIGN)
        with self._lock:
            self._reclaim()
            for i, (offset, free) in enumerate(self._free):
                if free >= size:  # first fit
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    break
            else:
                return None
        piece = self._array[offset : offset + size]
        weakref.finalize(piece, self._released.append, (offset, size))
        return torch.from_numpy(piece)

    def owns(self, buf: torch.Tensor) -> bool:
        start = self._base.data_ptr()
        return start <= buf.data_ptr() < start + self.capacity_bytes

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reclaim()
            return sum(size for _, size in self._free)

    def _reclaim(self) -> None:
        """Merge extents released by finalizers into the free list (caller holds the lock)."""
        while self._released:
            offset, size = self._released.popleft()
            i = bisect.bisect(self._free, (offset, size))
            self._free.insert(i, (offset, size))
            # Coalesce with the next and the previous extent.
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                size += self._free.pop(i + 1)[1]
                self._free[i] = (offset, size)
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                prev_offset, prev_size = self._free.pop(i - 1)
                self._free[i - 1] = (prev_offset, prev_size + size)
