"""Host-memory tier: block buffers kept after a model leaves the engine, so the
next start on this worker loads from memory instead of disk.

Bounded by bytes, least-recently-used first; blocks in use by an engine are
pinned and never evicted.
"""

from collections import OrderedDict

import torch

BlockKey = tuple[str, int]  # (model, block_id)


class HostBlockCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()
        self._pins: dict[BlockKey, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._blocks.values())

    def get(self, key: BlockKey) -> torch.Tensor | None:
        buf = self._blocks.get(key)
        if buf is not None:
            self._blocks.move_to_end(key)
        return buf

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def put(self, key: BlockKey, buf: torch.Tensor) -> list[BlockKey]:
        """Insert and return the keys evicted to make room (never pinned ones)."""
        self._blocks[key] = buf
        self._blocks.move_to_end(key)
        return self._evict()

    def pin(self, key: BlockKey) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: BlockKey) -> list[BlockKey]:
        n = self._pins.get(key, 0) - 1
        if n <= 0:
            self._pins.pop(key, None)
        else:
            self._pins[key] = n
        return self._evict()

    def remove(self, key: BlockKey) -> bool:
        """Drop an unpinned block now (a keep-alive ran out); False if pinned or absent."""
        if key in self._pins or key not in self._blocks:
            return False
        del self._blocks[key]
        return True

    def pinned(self, key: BlockKey) -> bool:
        return key in self._pins

    def keys(self) -> list[BlockKey]:
        return list(self._blocks)

    def _evict(self) -> list[BlockKey]:
        evicted: list[BlockKey] = []
        used = self.used_bytes
        for key in list(self._blocks):
            if used <= self.capacity_bytes:
                break
            if key in self._pins:
                continue
            buf = self._blocks.pop(key)
            used -= buf.numel() * buf.element_size()
            evicted.append(key)
        return evicted
