"""A full local model instance (all blocks) that serves requests step by step.

This first version runs requests one at a time inside step() (each with its own KV cache);
continuous batching will replace the loop behind the same add_request / cancel / step API.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import DynamicCache

from libs.checkpoint import CheckpointIndex, load_block

from .model import BlockSource, LayerRange
from .sampling import SamplingParams, make_generator, sample_token

FinishReason = Literal["stop", "length"]


class AdmissionError(Exception):
    """The engine cannot take this request (too long for max_seq_len, or no free slot)."""


@dataclass(frozen=True)
class TokenOutput:
    request_id: str
    token_id: int
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    cache: DynamicCache | None = None
    output_ids: list[int] = field(default_factory=list)


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Engine:
    def __init__(
        self,
        index: CheckpointIndex,
        blocks: Mapping[int, torch.Tensor] | BlockSource,
        device: str | torch.device = "cpu",
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.index = index
        self.device = torch.device(device)
        self.model = LayerRange(index, blocks, 0, index.n_blocks, device=self.device)
        self.vocab_size = int(index.config["vocab_size"])
        self.max_batch_size = max_batch_size
        self.max_seq_len = int(max_seq_len or index.config.get("max_position_embeddings", 2048))
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(index.config.get("eos_token_id"))
        self.eos_token_ids = frozenset(eos_token_ids)
        self._waiting: dict[str, _Request] = {}  # admitted, not yet prefilled (insertion order = FIFO)
        self._running: dict[str, _Request] = {}

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | os.PathLike, device: str | torch.device = "cpu", **kwargs) -> Engine:
        """Load every block of the block checkpoint in ckpt_dir and build an engine over them."""
        ckpt_dir = Path(ckpt_dir)
        index = CheckpointIndex.load(ckpt_dir)
        blocks = {b.id: load_block(ckpt_dir, index, b.id) for b in index.blocks}
        if "eos_token_ids" not in kwargs:
            # generation_config.json may list more end tokens than config.json (e.g. end of a chat turn).
            eos = set(_as_id_list(index.config.get("eos_token_id")))
            gen_path = ckpt_dir / "generation_config.json"
            if gen_path.is_file():
                eos |= set(_as_id_list(json.loads(gen_path.read_text()).get("eos_token_id")))
            kwargs["eos_token_ids"] = eos
        return cls(index, blocks, device=device, **kwargs)

    # -- request lifecycle ---------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id!r} is already in the engine")
        try:
            prompt_ids = [operator.index(t) for t in prompt_ids]  # ints, numpy ints; not floats
        except TypeError:
            raise ValueError("prompt_ids must be integers") from None
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise AdmissionError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_seq_len ({self.max_seq_len})"
            )
        if self.num_requests >= self.max_batch_size:
            raise AdmissionError(f"engine is full ({self.max_batch_size} requests)")
        self._waiting[request_id] = _Request(
            id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            generator=make_generator(params, self.device),
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
        )

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its KV cache; False if it is not in the engine (e.g. already finished)."""
        req = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
        return req is not None

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_requests(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - self.num_requests

    # -- execution -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Prefill newly added requests (first token each) and decode one token for each running request."""
        outputs: list[TokenOutput] = []
        for req in list(self._running.values()):
            ids = torch.tensor([[req.output_ids[-1]]], device=self.device)
            outputs.append(self._advance(req, self.model(ids, req.cache, logits_to_keep=1)))
        while self._waiting:
            req = self._waiting.pop(next(iter(self._waiting)))
            req.cache = self.model.new_cache()
            self._running[req.id] = req
            ids = torch.tensor([req.prompt_ids], device=self.device)
            outputs.append(self._advance(req, self.model(ids, req.cache, logits_to_keep=1)))
        return outputs

    def _advance(self, req: _Request, logits: torch.Tensor) -> TokenOutput:
        token = sample_token(logits[0, -1], req.params, req.generator)
        req.output_ids.append(token)
        reason: FinishReason | None = None
        if token in req.stop_ids:
            reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            del self._running[req.id]  # frees the KV cache
        return TokenOutput(req.id, token, reason is not None, reason, len(req.prompt_ids), len(req.output_ids))
