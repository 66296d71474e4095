"""The two sides of a live pair's split prefill (BlitzScale §5.2).

An overloaded instance (the source, every block) pairs with an instance still loading the
same model (the target). For a prefill pass the source picks k (per batch: ZigZag, in
libs/planning/livepair.py): the target runs blocks [0, k) of the pass on the blocks it
already holds (`PrefillFront`) and hands back the hidden state *and the KV of those blocks'
layers*; the source writes that KV into its own cache (`LocalStage.forward_rest`) and runs
blocks [k, n). So the request's KV ends up complete on the source, which decodes it alone:
only prefills are split (a decode step's one token is not worth a round trip, and a KV split
across workers would tie the request to the target until it ends). The target keeps a
request's front KV only while its prefill runs (a later chunk attends to the earlier ones) and
forgets it at the end: the pair dissolves by just ending, nothing of any request left there.

`RemoteFront` reaches a target's `PrefillFront` hosted by its StageServer over the data
plane's message channel (the execution pipelines' activations transport); its `submit` sends a
front without waiting, so the source's engine runs the step's decode passes while the target
computes (Engine._run_paired).
"""

from __future__ import annotations

import concurrent.futures
from typing import Protocol

import torch

from .kv import SlotKVCache, _kv_heads_and_dim
from .model import LayerRange, hf_config
from .stages import RemoteStage, read_kv


class Front(Protocol):
    """What the source's engine calls: a target's first blocks, with their KV handed back."""

    def open(self, request_id: str) -> None: ...

    def close(self, request_id: str) -> None: ...

    def forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: int
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def held(self) -> int:
        """Blocks 0..k-1 the target holds now (what a batch may run there)."""
        ...


def front_layers(model_or_index, blocks: int) -> int:
    """Layers in blocks [0, blocks) of the model."""
    index = getattr(model_or_index, "index", model_or_index)
    return index.blocks[blocks - 1].layer_end - index.blocks[0].layer_start


class PrefillFront:
    """The target's side: blocks [0, k) of the source's prefill passes over `model` (the loading
    instance's range, its blocks still arriving: a pass waits only for the blocks it runs), with
    a KV cache of its own for at most `max_blocks` blocks (a request's earlier chunks)."""

    def __init__(self, model: LayerRange, slots: int, max_seq_len: int, max_blocks: int | None = None):
        if model.block_start != 0:
            raise ValueError("a live pair's front starts at block 0")
        self.model = model
        self.max_blocks = model.block_end - 1 if max_blocks is None else max_blocks
        if not 0 < self.max_blocks < model.block_end:
            raise ValueError(f"max_blocks must be inside the model: 0 < {self.max_blocks} < {model.block_end}")
        self.kv = SlotKVCache(model.config, model.layer_start, front_layers(model, self.max_blocks), slots,
                              max_seq_len, model.device, model.dtype)
        self._slot: dict[str, int] = {}
        self.passes = 0  # forward passes served (how much of the source's prefill came here)

    @property
    def slots(self) -> int:
        return self.kv.slots

    def held(self) -> int:
        return min(self.model.leading_ready_blocks(), self.max_blocks)

    def open(self, request_id: str) -> None:
        if request_id in self._slot:
            raise ValueError(f"request {request_id!r} already holds a front slot")
        slot = self.kv.allocate()
        if slot is None:
            raise RuntimeError(f"no free front slot for {request_id!r} ({self.kv.slots} in use)")
        self._slot[request_id] = slot

    def close(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.kv.release(slot)

    @torch.inference_mode()
    def forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states after block `blocks` - 1, and the KV those blocks' layers computed for
        the pass ([2, layers, rows, kv heads, q_len, head dim])."""
        if not 0 < blocks <= self.max_blocks:
            raise ValueError(f"this front runs 1..{self.max_blocks} blocks, not {blocks}")
        view = self.kv.batch([self._slot[r] for r in request_ids], q_len)
        hidden = self.model(inputs, view, blocks=(0, blocks))
        kv = read_kv(self.kv, view.slots, view.starts, front_layers(self.model, blocks), q_len)
        view.commit()
        self.passes += 1
        return hidden, kv

    def front_call(self, header: dict, tensor: torch.Tensor) -> torch.Tensor:
        """A StageServer's front call: hidden and KV flattened into one reply tensor."""
        hidden, kv = self.forward([str(r) for r in header["request_ids"]], tensor, int(header["q_len"]),
                                  int(header["blocks"]))
        return torch.cat([hidden.reshape(-1), kv.to(hidden.dtype).reshape(-1)])


class RemoteFront:
    """A target's PrefillFront hosted by its StageServer (a stage id of its own), called over the
    data plane; the reply is the hidden state and the KV in one tensor, cut apart here."""

    def __init__(self, stage: RemoteStage, index):
        self.stage, self.index = stage, index
        self.hidden_size = int(index.config["hidden_size"])
        self.kv_heads, self.head_dim = _kv_heads_and_dim(hf_config(index))

    @property
    def slots(self) -> int:
        return self.stage.slots

    def open(self, request_id: str) -> None:
        self.stage.open(request_id)

    def close(self, request_id: str) -> None:
        self.stage.close(request_id)

    def abort(self, reason: str) -> None:
        self.stage.abort(reason)

    def held(self) -> int:
        return int(self.stage.call_op("held"))

    def forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.submit(request_ids, inputs, q_len, blocks).result()

    def submit(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: int) -> "FrontCall":
        """The front call sent without waiting: the source computes meanwhile; result() waits."""
        return FrontCall(self, self.stage.submit_front(request_ids, inputs, q_len, blocks), len(request_ids), q_len,
                         blocks)

    def _cut(self, flat: torch.Tensor, rows: int, q_len: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_hidden = rows * q_len * self.hidden_size
        hidden = flat[:n_hidden].view(rows, q_len, self.hidden_size)
        kv = flat[n_hidden:].view(2, front_layers(self.index, blocks), rows, self.kv_heads, q_len, self.head_dim)
        return hidden, kv


class FrontCall:
    """A RemoteFront call in flight: result() waits for the reply (at most the stage's timeout)."""

    def __init__(self, front: RemoteFront, future: concurrent.futures.Future, rows: int, q_len: int, blocks: int):
        self.front, self.future, self.rows, self.q_len, self.blocks = front, future, rows, q_len, blocks

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            flat = self.future.result(self.front.stage.timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no reply from the live pair's front {self.front.stage.stage_id} within "
                               f"{self.front.stage.timeout_s}s") from None
        return self.front._cut(flat, self.rows, self.q_len, self.blocks)
