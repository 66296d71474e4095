"""Host-memory tier: block buffers kept after a model leaves the engine, so the
next start on this worker loads from memory instead of disk.

Bounded by bytes and, optionally, by models (lambdaScale 2.3 sizes a node's host
memory in models: "up to 3"); least-recently-used first. Blocks in use by an
engine or kept for the parameter pool are pinned and never evicted.
"""

from collections import OrderedDict

import torch

BlockKey = tuple[str, int]  # (model, block_id)


class HostBlockCache:
    def __init__(self, capacity_bytes: int, max_models: int = 0):
        if max_models < 0:
            raise ValueError("max_models must be >= 0 (0: no bound)")
        self.capacity_bytes = capacity_bytes
        self.max_models = max_models  # 0: no bound on the number of models
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

    def models(self) -> list[str]:
        """Models with a block here, least recently used first (a model is as recent as its newest block)."""
        newest: dict[str, int] = {}
        for position, (model, _) in enumerate(self._blocks):
            newest[model] = position
        return sorted(newest, key=newest.__getitem__)

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
        if self.max_models:
            evicted += self._evict_models()
        return evicted

    def _evict_models(self) -> list[BlockKey]:
        """Over the model bound: drop whole models, least recently used first, skipping any
        with a pinned block (a model in use stays, and counts)."""
        evicted: list[BlockKey] = []
        models = self.models()
        pinned = {model for model, _ in self._pins}
        excess = len(models) - self.max_models
        for model in models:
            if excess <= 0:
                break
            if model in pinned:
                continue
            gone = [k for k in self._blocks if k[0] == model]
            for k in gone:
                del self._blocks[k]
            evicted += gone
            excess -= 1
        return evicted
