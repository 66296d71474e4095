"""The engine's KV cache: pre-allocated once, one slot per running request.

A stage's cache holds, for each of its layers, keys and values of shape
[slots, kv_heads, max_seq_len, head_dim], zero at start (so padding never
holds NaN). On the CPU that memory is an anonymous mapping, which the kernel
hands out zeroed page by page as it is first written: a cache costs its budget
in address space at once but memory only as its slots fill, and an engine
starts without writing gigabytes of zeros (seconds at a CPU quota, which an
execution pipeline formed mid-scale-out cannot afford). A fixed memory
budget gives the number of slots; a request
gets a slot on admission and keeps it until it ends, so the engine never
allocates per step and never runs out of memory mid-generation: when no slot
is free, new requests wait (or are refused) instead.

`SlotKVCache.batch(...)` gives the object a transformers attention layer calls
(`update(key, value, layer_idx)`) for one forward pass over a batch of
requests, each at its own position, plus the attention masks that keep each
row to its own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import math
import mmap

import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # The tensor holds the mapping (frombuffer keeps a reference): unmapped when the tensor goes.
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _kv_heads_and_dim(config) -> tuple[int, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return kv_heads, head_dim


def kv_bytes_per_slot(config, n_layers: int, max_seq_len: int, dtype: torch.dtype) -> int:
    kv_heads, head_dim = _kv_heads_and_dim(config)
    return 2 * n_layers * kv_heads * max_seq_len * head_dim * torch.empty((), dtype=dtype).element_size()


class SlotKVCache:
    def __init__(self, config, layer_start: int, layer_end: int, slots: int, max_seq_len: int,
                 device: torch.device, dtype: torch.dtype):
        if slots < 1:
            raise ValueError("a KV cache needs at least one slot")
        kv_heads, head_dim = _kv_heads_and_dim(config)
        self.layer_start, self.layer_end = layer_start, layer_end
        self.slots, self.max_seq_len = slots, max_seq_len
        shape = (slots, kv_heads, max_seq_len, head_dim)
        device = torch.device(device)
        self._head_shape, self._dtype = shape[1:], dtype
        self.keys = [_zeros(shape, dtype, device) for _ in range(layer_start, layer_end)]
        self.values = [_zeros(shape, dtype, device) for _ in range(layer_start, layer_end)]
        self.lengths = [0] * slots  # tokens held per slot
        self._free = list(range(slots - 1, -1, -1))
        self.device = torch.device(device)

    def resize(self, slots: int) -> dict[int, int]:
        """A new pool of `slots` slots holding every live slot's KV (elastic KV, LLM-Mesh §6.2):
        live slots are renumbered 0..k-1 in order; returns old slot id -> new. Refuses (ValueError)
        to go below the slots in use. Only the tokens held are copied: on the CPU the new pool's
        untouched pages cost no memory. With no slot in use the old pool is dropped first, so the
        two are never held at once."""
        free = set(self._free)
        live = [s for s in range(self.slots) if s not in free]
        if slots < max(len(live), 1):
            raise ValueError(f"cannot resize a KV cache to {slots} slots: {len(live)} in use")
        moved = {old: new for new, old in enumerate(live)}
        old_pools = (*self.keys, *self.values)
        count = len(old_pools)
        if not live:  # nothing to keep: the old pool goes before the new one comes (never both held)
            self.keys, self.values, old_pools = [], [], ()
        try:
            new_pools = [_zeros((slots, *self._head_shape), self._dtype, self.device) for _ in range(count)]
        except BaseException:
            if not live:  # an empty pool of the old size again (nothing was in it)
                pools = [_zeros((self.slots, *self._head_shape), self._dtype, self.device) for _ in range(count)]
                self.keys, self.values = pools[: count // 2], pools[count // 2:]
            raise
        for old_t, new_t in zip(old_pools, new_pools):
            for old, new in moved.items():
                if n := self.lengths[old]:
                    new_t[new, :, :n] = old_t[old, :, :n]
        half = len(new_pools) // 2
        self.keys, self.values = new_pools[:half], new_pools[half:]
        self.lengths = [self.lengths[s] for s in live] + [0] * (slots - len(live))
        self._free = list(range(slots - 1, len(live) - 1, -1))
        self.slots = slots
        return moved

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot `dst` holds the first `length` tokens of slot `src` (the choices of one prompt
        share its prefill: n > 1)."""
        if not 0 < length <= self.lengths[src]:
            raise ValueError(f"slot {src} holds {self.lengths[src]} tokens, cannot copy {length}")
        for t in (*self.keys, *self.values):
            t[dst, :, :length] = t[src, :, :length]
        self.lengths[dst] = length

    def batch(self, slots: Sequence[int], q_len: int) -> BatchView:
        """A view for one forward pass: `q_len` new tokens for every row, at each slot's length."""
        for s in slots:
            if self.lengths[s] + q_len > self.max_seq_len:
                raise ValueError(f"slot {s}: {self.lengths[s]} + {q_len} tokens exceed max_seq_len {self.max_seq_len}")
        return BatchView(self, list(slots), q_len)


class BatchView:
    """What attention layers see as `past_key_values` for one batched forward pass."""

    def __init__(self, cache: SlotKVCache, slots: list[int], q_len: int):
        self.cache, self.slots, self.q_len = cache, slots, q_len
        self.starts = [cache.lengths[s] for s in slots]
        self.kv_len = max(self.starts) + q_len
        self._contiguous = len(slots) == 1  # one row: slice instead of gather (no copy)
        # Built once per forward pass, not once per layer.
        self._index = torch.tensor(slots, device=cache.device)
        self._starts = torch.tensor(self.starts, device=cache.device)

    def position_ids(self) -> torch.Tensor:
        return self._starts.unsqueeze(1) + torch.arange(self.q_len, device=self.cache.device).unsqueeze(0)

    def masks(self, layer_types: set[str], sliding_window: int | None) -> dict[str, torch.Tensor | None]:
        """Boolean masks [batch, 1, q, kv] (True: attend) per attention type; None where plain causal suffices.

        A single row starting from an empty cache (a prefill) or a single row decoding one token
        needs no mask, as in transformers' own forward, so single requests compute exactly as
        `generate()` does.
        """
        out: dict[str, torch.Tensor | None] = {}
        device = self.cache.device
        q_pos = self.position_ids().unsqueeze(-1)  # [B, q, 1]
        k_pos = torch.arange(self.kv_len, device=device).view(1, 1, -1)  # [1, 1, kv]
        for lt in layer_types:
            window = sliding_window if lt == "sliding_attention" else None
            single = len(self.slots) == 1 and (self.starts[0] == 0 or self.q_len == 1)
            if single and (window is None or self.kv_len <= window):
                out[lt] = None
                continue
            allowed = k_pos <= q_pos
            if window is not None:
                allowed = allowed & (q_pos - k_pos < window)
            out[lt] = allowed.unsqueeze(1)
        return out

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        i = layer_idx - self.cache.layer_start
        keys, values = self.cache.keys[i], self.cache.values[i]
        if self._contiguous:
            s, start = self.slots[0], self.starts[0]
            keys[s, :, start:start + self.q_len] = key[0]
            values[s, :, start:start + self.q_len] = value[0]
            return keys[s:s + 1, :, : self.kv_len], values[s:s + 1, :, : self.kv_len]
        if self.q_len == 1:
            keys[self._index, :, self._starts] = key[:, :, 0]
            values[self._index, :, self._starts] = value[:, :, 0]
        else:  # several rows of q_len tokens each (a batched prefill): row r's at starts[r]..
            positions = self._starts.unsqueeze(1) + torch.arange(self.q_len, device=self.cache.device)
            rows = self._index.unsqueeze(1).expand_as(positions)
            keys[rows, :, positions] = key.transpose(1, 2)  # [B, q, heads, dim]
            values[rows, :, positions] = value.transpose(1, 2)
        return keys[self._index, :, : self.kv_len], values[self._index, :, : self.kv_len]

    def commit(self) -> None:
        """The forward pass ran: every row now holds q_len more tokens."""
        for s in self.slots:
            self.cache.lengths[s] += self.q_len
