"""A serving engine over one model: continuous batching on a pre-allocated KV cache, any split into stages.

Iteration-level scheduling (Orca): requests join and leave between steps. Each
step decodes one token for every running request in one batched forward pass,
then spends what is left of the step's token budget on prefill chunks of
requests being admitted (a long prompt is prefilled over several steps, so it
never stalls the decodes). Every request holds one slot of each stage's KV
cache (kv.py) from admission to its end; when none is free, requests wait in a
bounded queue, and beyond it are refused with AdmissionError: never an
out-of-memory error mid-generation.

The model runs as a chain of stages, each a contiguous layer range with its own
KV cache (the KV for a request lives with the stage that computed it): one
stage for a local instance, several for a pipeline. A stage may be local or
remote (stages.py: activations over the data plane's message channel). The
engine sits with the first stage and samples from the last stage's logits.

KV recompute: a request can join with tokens it already generated elsewhere
(`generated_ids`); one prefill rebuilds its cache and decoding continues where
it stopped (λScale §4.4 mode switch, ServerlessLLM §5.2 live migration). With
`hold=True` it stays paused after that prefill so the source can hand over the
tokens it produced meanwhile (`catch_up`) before decoding moves (`release`).

Choices (SamplingSpec.n > 1): one request, n completions of its prompt. Each
choice is a row of its own (its KV slot, generator, output and finish), admitted
together (n slots at once, or the request waits). The prompt is prefilled once,
by the first choice; its KV is then copied into the others' slots on every stage
(`Stage.fork`) and each choice samples its first token from the same logits.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import operator
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from libs.checkpoint import CheckpointIndex, load_block
from libs.planning.ahead import AHEAD_TOKEN_LIMIT, ahead_passes, passes_to_finish
from libs.planning.microbatches import MicroBatch, MicroBatchSchedule

from .grammar import Constraint, grammar_tokenizer
from .kv import kv_bytes_per_slot
from .livepair import Front
from .model import BlockSource, LayerRange
from .sampling import SamplingSpec, make_generator, sample_token, token_logprobs
from .stages import LocalStage, Stage

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]

DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_TOKEN_BUDGET = 2048  # tokens per step: decodes first, prefill chunks with the rest
DEFAULT_PREFILL_CHUNK = 512


class AdmissionError(Exception):
    """The engine cannot take this request: too long for max_seq_len, or the KV slots and queue are full."""


@dataclass(frozen=True)
class TokenOutput:
    request_id: str
    token_id: int
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    # With SamplingSpec.logprobs set: the token's log-probability under the model (raw
    # log-softmax, before penalties and temperature) and the top (token id, logprob) pairs.
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    choice: int = 0  # which of the request's n choices (SamplingSpec.n) the token belongs to


@dataclass(frozen=True)
class StepShape:
    """What one step computed (live profile refresh, LLM-Mesh §5.2): the rows it decoded and
    their mean sequence length, and the prompt tokens it prefilled over how many rows."""

    decode_rows: int
    decode_mean_len: float
    prefill_tokens: int
    prefill_rows: int


@dataclass
class _Request:
    """One choice of a request (a request with n = 1 is its choice 0): a KV slot's row."""

    id: str
    prompt_ids: list[int]
    params: SamplingSpec
    generator: torch.Generator
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)  # context tokens not yet in the KV cache
    held: bool = False  # recomputed, waiting for release() before it decodes
    started: bool = False  # holds KV slots
    constraint: Constraint | None = None  # its grammar's state (SamplingSpec.grammar)
    choice: int = 0
    # n > 1: the choice that prefills the prompt, for the others (`forks`) until it has; they
    # wait for a copy of its KV. Its own resumed tokens (`tail`) go in after the copy.
    parent: _Request | None = None
    forks: list[_Request] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)

    @property
    def key(self) -> str:
        """Its KV slots' name on every stage (choice 0: the request id, as for n = 1)."""
        return self.id if self.choice == 0 else f"{self.id}#{self.choice}"


@dataclass
class _Pass:
    """One forward pass of a step: a micro-batch of decodes, or prefill chunks of one length."""

    requests: list[_Request]
    inputs: torch.Tensor
    q_len: int
    sample: tuple[bool, ...]  # per row: its last position gives the request's next token
    prefill: bool = False

    @property
    def ids(self) -> list[str]:
        return [r.key for r in self.requests]  # the rows' KV slot names on the stages


# What a live pair's target failing looks like to its source (the pass then runs locally).
_PAIR_FAILURES = (ConnectionError, TimeoutError, RuntimeError)


@dataclass
class _Ahead:
    """A prefill pass run ahead of the load (Engine.prefill_ahead): its hidden state after blocks
    [block_start, done), its KV of those layers written but not yet counted."""

    pass_: _Pass
    x: torch.Tensor
    done: int


@dataclass
class _Flight:
    """A micro-batch in a pipeline's stages: its passes, each one's input to the stage it is at
    (its output once it left the last), and the replies awaited from a stage elsewhere."""

    mb: MicroBatch
    passes: list[_Pass]
    x: list[torch.Tensor]
    futures: list[concurrent.futures.Future] | None = None


def _split(items: list, parts: int) -> list[list]:
    """`items` in at most `parts` contiguous groups whose sizes differ by one at most."""
    parts = min(parts, len(items))
    size, extra = divmod(len(items), parts) if parts else (0, 0)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(items[at:at + n])
        at += n
    return out


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Engine:
    def __init__(
        self,
        index: CheckpointIndex,
        blocks: Mapping[int, torch.Tensor] | BlockSource | None = None,
        device: str | torch.device = "cpu",
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        *,
        stages: Sequence[Stage] | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_queue: int | None = None,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        tokenizer_dir: str | os.PathLike | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if token_budget < max_batch_size + 1 or prefill_chunk < 1:
            raise ValueError("token_budget must exceed max_batch_size and prefill_chunk must be >= 1")
        self.index = index
        self.device = torch.device(device)
        self.vocab_size = int(index.config["vocab_size"])
        self.max_seq_len = int(max_seq_len or index.config.get("max_position_embeddings", 2048))
        if stages is None:
            if blocks is None:
                raise ValueError("give the blocks (or the stages) to run")
            model = LayerRange(index, blocks, 0, index.n_blocks, device=self.device)
            stages = [budgeted_stage(model, max_batch_size, self.max_seq_len, kv_cache_bytes)]
        self.stages = list(stages)
        self.max_batch_size = min(max_batch_size, *(st.slots for st in self.stages))
        self.max_queue = 4 * self.max_batch_size if max_queue is None else max_queue
        self.token_budget, self.prefill_chunk = token_budget, prefill_chunk
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(index.config.get("eos_token_id"))
        self.eos_token_ids = frozenset(eos_token_ids)
        # The checkpoint's tokenizer files: read only once a request comes with a grammar.
        self.tokenizer_dir = None if tokenizer_dir is None else str(tokenizer_dir)
        # request id -> its choices, waiting for KV slots (FIFO; admitted together)
        self._queue: OrderedDict[str, list[_Request]] = OrderedDict()
        self._active: OrderedDict[str, _Request] = OrderedDict()  # choice key -> choice holding KV slots
        self.last_step: StepShape | None = None
        # A live pair (BlitzScale §5.2, pair_with): the target's front and the per-batch split.
        self._front: Front | None = None
        self._splitter: Callable[[list[str]], int] | None = None
        self._split_of: dict[str, int] = {}  # choice key -> blocks its prefill runs on the front (0: none)
        self.pair_error: str | None = None  # why the last pair ended on a failure of its target
        self._on_lost: Callable[[str], None] | None = None
        # Stages elsewhere: micro-batches stay in flight across steps (2D pipelining).
        self._schedule = MicroBatchSchedule(len(self.stages)) if self.micro_batches > 1 else None
        self._flights: dict[int, _Flight] = {}  # micro-batch id -> its passes
        self._closing: dict[str, _Request] = {}  # cancelled while in flight: its slots free once it lands
        # Execute while loading: the first prefill passes, run through the blocks landed so far.
        self._ahead: list[_Ahead] = []
        self._ahead_failed = False  # a block failed to arrive: nothing more runs ahead
        self.ahead_blocks = 0  # blocks of prefill passes run before the load ended (a counter)

    @property
    def model(self) -> LayerRange:
        """The first local stage's layer range (the whole model for a local instance)."""
        return next(st.model for st in self.stages if isinstance(st, LocalStage))

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | os.PathLike, device: str | torch.device = "cpu",
                        splits: Sequence[int] = (), **kwargs) -> Engine:
        """Load every block of the block checkpoint in ckpt_dir and build an engine over them.

        `splits` (block ids) cut the model into local stages, e.g. (2,) runs blocks [0,2) and
        [2,n) as a two-stage pipeline in this process.
        """
        ckpt_dir = Path(ckpt_dir)
        index = CheckpointIndex.load(ckpt_dir)
        blocks = {b.id: load_block(ckpt_dir, index, b.id) for b in index.blocks}
        kwargs.setdefault("eos_token_ids", checkpoint_eos_ids(ckpt_dir, index))
        kwargs.setdefault("tokenizer_dir", ckpt_dir)
        if splits:
            kwargs["stages"] = local_stages(index, blocks, splits, device, kwargs.get("max_batch_size", 8),
                                            int(kwargs.get("max_seq_len") or index.config.get(
                                                "max_position_embeddings", 2048)))
        return cls(index, blocks, device=device, **kwargs)

    @classmethod
    def live_pair(cls, index: CheckpointIndex, blocks: Mapping[int, torch.Tensor], target: Stage, split: int,
                  device: str | torch.device = "cpu", max_batch_size: int = 8, max_seq_len: int | None = None,
                  **kwargs) -> Engine:
        """BlitzScale §5.2 live pair, on the overloaded source: the loading target runs blocks [0, split)
        (`target`, usually a RemoteStage), this worker the rest over the blocks it already serves
        (views: no extra weight memory; the pair's KV is its own)."""
        if not 0 < split < index.n_blocks:
            raise ValueError(f"a live pair splits inside the model: 0 < split < {index.n_blocks}, got {split}")
        seq = int(max_seq_len or index.config.get("max_position_embeddings", 2048))
        tail = LocalStage(LayerRange(index, blocks, split, index.n_blocks, device=device),
                          min(max_batch_size, target.slots), seq)
        return cls(index, device=device, max_batch_size=max_batch_size, max_seq_len=seq, stages=[target, tail],
                   **kwargs)

    # -- request lifecycle ---------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingSpec,
                    generated_ids: Sequence[int] = (), hold: bool = False,
                    choices: Mapping[int, Sequence[int]] | None = None) -> None:
        """Queue a request; `generated_ids`: tokens it already produced elsewhere (KV recompute).
        With n > 1, `choices` resumes it: the choices still to run (indices < n), each with the
        tokens it already produced (None: all n from the start)."""
        if self._choices(request_id):
            raise ValueError(f"request {request_id!r} is already in the engine")
        prompt_ids = self._check_ids(prompt_ids, "prompt_ids")
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if choices is None:
            choices = {0: generated_ids} if params.n == 1 else {i: () for i in range(params.n)}
        elif generated_ids or not choices or not set(choices) <= set(range(params.n)):
            raise ValueError(f"choices: a non-empty map of choice indices < n ({params.n}) to their tokens, "
                             "instead of generated_ids")
        runs = {c: self._check_ids(ids, "generated_ids", allow_empty=True) for c, ids in sorted(choices.items())}
        if hold and (len(runs) > 1 or not next(iter(runs.values()))):
            raise ValueError("only a request that resumes (generated_ids) with one choice can be held")
        for generated in runs.values():
            if len(generated) >= params.max_tokens:
                raise ValueError(f"{len(generated)} tokens already generated: nothing left of max_tokens "
                                 f"({params.max_tokens})")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise AdmissionError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_seq_len ({self.max_seq_len})"
            )
        if len(runs) > self.max_batch_size:  # its choices run at once, a KV slot each
            raise AdmissionError(f"n={len(runs)} choices need as many KV slots; this engine has "
                                 f"{self.max_batch_size}")
        if self.num_requests + len(runs) > self.max_batch_size + self.max_queue:
            raise AdmissionError(f"engine is full ({self.max_batch_size} running, {len(self._queue)} queued)")
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)
        if params.grammar is not None and self.tokenizer_dir is None:
            raise ValueError("this engine has no tokenizer for grammars (tokenizer_dir)")
        group = []
        for c, generated in runs.items():
            constraint = None
            if params.grammar is not None:  # one grammar state per choice
                constraint = Constraint(grammar_tokenizer(self.tokenizer_dir), params.grammar, self.vocab_size,
                                        stop_ids)
                constraint.consume(generated)  # resumed elsewhere: the grammar goes on where it was
            group.append(_Request(
                id=request_id, prompt_ids=prompt_ids, params=params, choice=c,
                generator=make_generator(params, self.device, choice=c), stop_ids=stop_ids,
                output_ids=list(generated),
                # The last generated token is fed by the first decode step, as if it had just been sampled.
                pending=prompt_ids + list(generated[:-1]),
                held=hold,
                constraint=constraint,
            ))
        if len(group) > 1:  # the first prefills the prompt; the others get a copy of its KV
            first = group[0]
            first.forks = group[1:]
            first.tail, first.pending = first.pending[len(prompt_ids):], list(prompt_ids)
            for other in first.forks:
                other.parent, other.pending = first, other.pending[len(prompt_ids):]
        self._queue[request_id] = group

    def _choices(self, request_id: str) -> list[_Request]:
        """The request's choices in the engine (queued or running)."""
        return self._queue.get(request_id) or [r for r in self._active.values() if r.id == request_id]

    def _only(self, request_id: str) -> _Request | None:
        """The request's one choice (n = 1 operations: the hand-over's catch-up)."""
        found = self._choices(request_id)
        return found[0] if len(found) == 1 else None

    def _check_ids(self, ids: Sequence[int], what: str, allow_empty: bool = False) -> list[int]:
        try:
            ids = [operator.index(t) for t in ids]  # ints, numpy ints; not floats
        except TypeError:
            raise ValueError(f"{what} must be integers") from None
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what}: token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def catch_up(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens a held request's source generated meanwhile (second stage of the catch-up)."""
        req = self._only(request_id)
        if req is None or not req.held:
            raise ValueError(f"request {request_id!r} is not held in this engine")
        ids = self._check_ids(token_ids, "token_ids", allow_empty=True)
        if len(req.output_ids) + len(ids) >= req.params.max_tokens:
            raise ValueError("catching up would reach max_tokens: let the source finish the request")
        if ids:
            if req.constraint is not None:
                req.constraint.consume(ids)
            req.pending += [req.output_ids[-1], *ids[:-1]]
            req.output_ids += ids

    def release(self, request_id: str) -> None:
        """A held request starts decoding here (its source has stopped)."""
        req = self._only(request_id)
        if req is None:
            raise ValueError(f"request {request_id!r} is not in this engine")
        req.held = False

    def cancel(self, request_id: str) -> bool:
        """Drop a request (all its choices) and free its KV slots; False if it is not in the
        engine (e.g. already finished)."""
        if self._queue.pop(request_id, None) is not None:
            return True
        if any(r.id == request_id for a in self._ahead for r in a.pass_.requests):
            self._drop_ahead()  # its slot may be reused: the passes run again, without it
        running = [r for r in self._active.values() if r.id == request_id]
        busy = self._schedule.busy() if self._schedule is not None else set()
        for req in running:
            del self._active[req.key]
            if req.key in busy:  # a stage may still compute it: its slots free when it lands
                self._closing[req.key] = req
            else:
                self._close(req)
        return bool(running)

    def abort_remote_stages(self, reason: str) -> None:
        """Thread-safe: calls waiting on other workers' stages fail now (see RemoteStage.abort)."""
        for st in self.stages:
            if hasattr(st, "abort"):
                st.abort(reason)

    def has_work(self) -> bool:
        """Something to compute: queued requests, prefills, or decodes (held requests wait)."""
        return bool(self._queue) or bool(self._flights) or bool(self._ahead) or any(
            r.pending or (not r.held and r.output_ids) for r in self._active.values())

    @property
    def num_requests(self) -> int:
        """Choices queued or running (each takes a KV slot when it runs)."""
        return sum(map(len, self._queue.values())) + len(self._active)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self._active) - len(self._closing)

    # -- elastic KV (LLM-Mesh §6.2) ----------------------------------------------------------

    @property
    def kv_slots(self) -> int:
        """KV slots each local stage holds now."""
        return min(st.slots for st in self.stages if isinstance(st, LocalStage))

    @property
    def kv_slot_bytes(self) -> int:
        """What one KV slot costs across the local stages."""
        return sum(st.kv.nbytes // st.kv.slots for st in self.stages if isinstance(st, LocalStage))

    def resize_kv(self, slots: int) -> None:
        """Every local stage's KV cache to `slots` slots, running requests keeping their KV, and
        the engine admits up to `slots` at once. All stages or none: a stage that fails puts the
        ones already resized back. ValueError below the slots in use, or with a remote stage
        (its cache is another worker's)."""
        if not all(isinstance(st, LocalStage) for st in self.stages):
            raise ValueError("an engine with remote stages cannot resize their KV caches")
        if slots < max(len(self._active), 1):
            raise ValueError(f"cannot resize the KV cache to {slots} slots: {len(self._active)} in use")
        if slots >= self.token_budget:  # the constructor's rule: a step decodes every slot, with room to prefill
            raise ValueError(f"{slots} slots need a token budget above {self.token_budget}")
        self._drop_ahead()  # a resize keeps each slot's counted tokens only
        done: list[tuple[LocalStage, int]] = []
        try:
            for st in self.stages:
                old = st.slots
                st.resize(slots)
                done.append((st, old))
        except BaseException:
            for st, old in reversed(done):
                st.resize(old)
            raise
        self.max_batch_size = slots

    def context_ids(self, request_id: str) -> list[int]:
        """Prompt + generated tokens of a request: what another worker needs to take it over."""
        req = self._only(request_id)
        if req is None:
            raise KeyError(request_id)
        return req.prompt_ids + req.output_ids

    # -- execution -----------------------------------------------------------------------

    def runnable(self) -> bool:
        """A step would not wait for a block still arriving (the worker's engine thread steps only
        engines that can run, so one loading instance never stalls the others)."""
        return all(st.model.runnable() for st in self.stages if isinstance(st, LocalStage))

    @property
    def micro_batches(self) -> int:
        """Micro-batches kept in flight: one per stage when a stage runs elsewhere (2D pipelining,
        λScale Fig. 6a: each stage computes a different micro-batch at once, across steps)."""
        return len(self.stages) if any(hasattr(st, "submit") for st in self.stages) else 1

    def _admit(self) -> None:
        # A request's choices are admitted together (none ever waits for a slot mid-request); in order.
        # A slot whose cancelled row is still in a stage is not free yet.
        while self._queue and (len(self._active) + len(self._closing) + len(next(iter(self._queue.values())))
                               <= self.max_batch_size):
            group = next(iter(self._queue.values()))
            if any(req.key in self._closing for req in group):  # the same request, cancelled, still in flight
                break
            for req in self._queue.popitem(last=False)[1]:
                for stage in self.stages:
                    stage.open(req.key)
                req.started = True
                self._active[req.key] = req

    @torch.inference_mode()
    def step(self) -> list[TokenOutput]:
        """Admit, decode one token for every running request, then prefill with what is left of the budget.

        With stages elsewhere (a pipeline), a step is a micro-batch's: the rows go in up to one
        micro-batch per stage, kept in flight across steps, and the step returns the tokens of the
        micro-batches that left the last stage (at least one, when any is in flight)."""
        self._admit()
        if self._ahead:
            return self._finish_ahead()
        if self._schedule is not None:
            return self._step_pipelined()
        decoding, passes = self._decode_passes()
        prefills = self._prefill_passes(self.token_budget - len(decoding))
        passes += prefills
        self.last_step = StepShape(
            len(decoding), sum(len(r.prompt_ids) + len(r.output_ids) for r in decoding) / max(1, len(decoding)),
            sum(p.q_len * len(p.requests) for p in prefills), len({r.key for p in prefills for r in p.requests}))
        return self._sampled(passes, self._run_passes(passes))

    def _decode_passes(self, exclude: set = frozenset()) -> tuple[list[_Request], list[_Pass]]:
        """The rows that decode a token this step (not `exclude`: rows whose prefill ran ahead of
        the load and is not finished), and their passes, one per micro-batch."""
        decoding = [r for r in self._active.values() if not r.pending and not r.held and r.output_ids
                    and r.parent is None and r.key not in exclude]
        passes = []
        for group in _split(decoding, self.micro_batches):
            ids = torch.tensor([[r.output_ids[-1]] for r in group], device=self.device)
            passes.append(_Pass(group, ids, 1, sample=(True,) * len(group)))
        return decoding, passes

    def _sampled(self, passes: list[_Pass], outs: list[torch.Tensor]) -> list[TokenOutput]:
        """The tokens sampled from the passes' logits (rows cancelled meanwhile left out)."""
        outputs: list[TokenOutput] = []
        for p, logits in zip(passes, outs):
            for i, r in enumerate(p.requests):
                if self._active.get(r.key) is not r:
                    continue  # cancelled while its pass was in a stage
                # The prompt is in: its other choices get its KV (before this one may finish and
                # free it) and sample their first token from the same logits.
                forked = self._fork(r) if r.forks and not r.pending else []
                if p.sample[i]:
                    outputs.append(self._advance(r, logits[i, -1]))
                outputs += [self._advance(f, logits[i, -1]) for f in forked if not f.output_ids]
        return outputs

    # -- execute while loading (λScale §4: inference starts before the model is all in) ----------

    def prefill_ahead(self) -> bool:
        """While the model's blocks still arrive (a serve-while-loading instance), run the waiting
        prefills through the leading blocks that have landed, keeping their hidden states: the
        step once every block is in runs only the rest, so their first tokens come about one
        block's compute after the last block rather than a whole prefill after. A request that
        comes later catches up through the landed blocks in its own pass. Never waits for a
        block (the worker's engine thread calls it between other engines' steps); runs one pass a
        call, the first admitted that is behind; False when it computed nothing. One local stage
        only (a pipeline's stages are loaded before it serves; a live pair's source holds every
        block)."""
        if (self._ahead_failed or self._front is not None or len(self.stages) != 1
                or not isinstance(self.stages[0], LocalStage) or self.runnable()):
            return False
        stage = self.stages[0]
        # The last block runs in step(): it is the part that counts the passes' tokens in.
        upto = min(stage.model.block_start + stage.model.leading_ready_blocks(), stage.model.block_end - 1)
        if upto <= stage.model.block_start:
            return False
        self._admit()
        ahead_rows = {r.key for a in self._ahead for r in a.pass_.requests}
        waiting = [r for r in self._active.values() if r.pending and r.parent is None and r.key not in ahead_rows]
        for p in self._whole_prompt_passes(waiting):
            self._ahead.append(_Ahead(p, p.inputs, stage.model.block_start))
        # One pass a call, the first admitted that is behind: it runs through the blocks landed
        # before later passes do, so the steps after the load finish it first; the engine
        # thread calls again at once while this returns True.
        front = max((a.done for a in self._ahead), default=stage.model.block_start)
        a = next((a for a in self._ahead if a.done < upto), None)
        if a is None:
            return False
        try:
            a.x = stage.forward_blocks(a.pass_.ids, a.x, a.pass_.q_len, (a.done, upto))
        except Exception as e:  # a block that failed to load: the step after the load fails as before
            log.warning("prefill ahead of the load stopped: %s", e)
            self._drop_ahead()
            self._ahead_failed = True
            return False
        a.done = upto
        self.ahead_blocks += max(0, upto - front)  # blocks run ahead by the foremost pass
        return True

    def _whole_prompt_passes(self, waiting: list[_Request]) -> list[_Pass]:
        """The waiting rows' whole contexts, up to AHEAD_TOKEN_LIMIT tokens in all, in passes of
        one length (no padding) and at most a step's budget (libs.planning.ahead): nothing decodes
        while the model loads, so the prefill chunk (which keeps decodes' gaps short) has nothing
        to protect, and the steps after the load finish the passes a budget at a time."""
        room = AHEAD_TOKEN_LIMIT - sum(a.pass_.q_len * len(a.pass_.requests) for a in self._ahead)
        groups = ahead_passes([len(r.pending) for r in waiting], room, self.token_budget, first_fits=not self._ahead)
        passes = []
        for group in groups:
            rows = [waiting[i] for i in group]
            chunks = []
            for r in rows:
                chunks.append(r.pending)
                r.pending = []
            passes.append(_Pass(rows, torch.tensor(chunks, device=self.device), len(chunks[0]),
                                sample=tuple(not r.output_ids for r in rows), prefill=True))
        return passes

    def _finish_ahead(self) -> list[TokenOutput]:
        """A step once every block is in: the running rows' decode pass, and the passes run ahead
        that fit the rest of the budget (first admitted first, at least one, only those as far
        along as the first; a pass counts its tokens times the share of the layers it has left:
        libs.planning.ahead) through their remaining blocks; the others wait for the next steps."""
        decoding, passes = self._decode_passes({r.key for a in self._ahead for r in a.pass_.requests})
        outs = self._run_passes(passes)
        # A pass costs its tokens times the share of the layers it has left.
        stage = self.stages[0]
        blocks = stage.model.block_end - stage.model.block_start
        k = passes_to_finish([a.pass_.q_len * len(a.pass_.requests) for a in self._ahead],
                             [(stage.model.block_end - a.done) / blocks for a in self._ahead],
                             self.token_budget - len(decoding))
        done, self._ahead = self._ahead[:k], self._ahead[k:]
        outs += [stage.forward_blocks(a.pass_.ids, a.x, a.pass_.q_len, (a.done, stage.model.block_end),
                                      logits_to_keep=1) for a in done]
        self.last_step = None  # only part of the model ran for some rows: no sample for the live profile
        return self._sampled(passes + [a.pass_ for a in done], outs)

    def _drop_ahead(self) -> None:
        """Forget the passes run ahead: their chunks go back to their rows, to be prefilled again
        at the same positions (the KV they wrote there is not counted, and is overwritten then)."""
        ahead, self._ahead = self._ahead, []
        for a in ahead:
            for i, r in enumerate(a.pass_.requests):
                r.pending = a.pass_.inputs[i].tolist() + r.pending

    # -- 2D pipelining across steps (λScale Fig. 6a) --------------------------------------------

    def _step_pipelined(self) -> list[TokenOutput]:
        """Start micro-batches while the schedule has room, move them through the stages (local
        ones computed here, the others' calls sent as soon as a micro-batch reaches them) until
        at least one left the last stage; sample its rows. The others stay in flight: a row's
        next step starts as soon as its token is sampled, whatever the other micro-batches do."""
        try:
            self._launch()
            landed: list[_Flight] = []
            while self._flights and not landed:
                landed = self._drive()
                if not landed:
                    landed = self._wait()
        except BaseException:
            self._abandon()
            raise
        passes = [p for f in landed for p in f.passes]
        decodes = [r for p in passes if not p.prefill for r in p.requests]
        prefills = [p for p in passes if p.prefill]
        self.last_step = StepShape(
            len(decodes), sum(len(r.prompt_ids) + len(r.output_ids) for r in decodes) / max(1, len(decodes)),
            sum(p.q_len * len(p.requests) for p in prefills), len({r.key for p in prefills for r in p.requests}))
        outputs = self._sampled(passes, [x for f in landed for x in f.x])
        for f in landed:
            for key in f.mb.rows:
                if key in self._closing:
                    self._close(self._closing.pop(key))
        return outputs

    def _launch(self) -> None:
        """New micro-batches, while fewer than one per stage are in flight and rows are free."""
        rows = [r for r in self._active.values() if r.parent is None]  # (forks wait for their parent's KV)
        while self._schedule.free():
            decoding = [r.key for r in rows if not r.pending and not r.held and r.output_ids]
            waiting = [r.key for r in rows if r.pending]
            group = self._schedule.next_group(decoding, waiting)
            if group is None:
                return
            decodes = [self._active[k] for k in group[0]]
            passes = []
            if decodes:
                ids = torch.tensor([[r.output_ids[-1]] for r in decodes], device=self.device)
                passes.append(_Pass(decodes, ids, 1, sample=(True,) * len(decodes)))
            prefills = self._prefill_passes(self.token_budget - len(decodes),
                                            [self._active[k] for k in group[1]], parts=1)
            passes += prefills
            prefilled = list(dict.fromkeys(r.key for p in prefills for r in p.requests))
            mb = self._schedule.start(group[0], prefilled)
            self._flights[mb.id] = _Flight(mb, passes, [p.inputs for p in passes])

    def _drive(self) -> list[_Flight]:
        """Send the micro-batches that reached a stage elsewhere, compute those at a local stage
        (each stage's queue in order), until none is left to compute here; the flights that left
        the last stage."""
        last = len(self.stages) - 1
        landed: list[_Flight] = []
        while True:
            for mb in self._schedule.in_flight:
                flight, s = self._flights[mb.id], self._schedule.at(mb.id)
                if hasattr(self.stages[s], "submit") and flight.futures is None:
                    flight.futures = [self.stages[s].submit(p.ids, x, p.q_len, 1 if s == last else 0)
                                      for p, x in zip(flight.passes, flight.x)]
            local = next(((mb, s) for s, st in enumerate(self.stages) if not hasattr(st, "submit")
                          for mb in self._schedule.queue(s)[:1]), None)
            if local is None:
                return landed
            mb, s = local
            flight = self._flights[mb.id]
            flight.x = [self.stages[s].forward(p.ids, x, p.q_len, logits_to_keep=1 if s == last else 0)
                        for p, x in zip(flight.passes, flight.x)]
            if self._schedule.passed(mb.id):
                landed.append(self._flights.pop(mb.id))

    def _wait(self) -> list[_Flight]:
        """Wait for a stage elsewhere to answer; the micro-batches it moved on (queue order), those
        that left the last stage returned."""
        waiting = [f for f in self._flights.values() if f.futures is not None]
        if not waiting:
            raise RuntimeError("micro-batches in flight, none computing: the pipeline is stuck")
        # The first of each stage's queue is the one that can move on: wait until one has every reply.
        heads = [f for f in waiting if self._schedule.queue(self._schedule.at(f.mb.id))[0] is f.mb]
        timeout = max(getattr(self.stages[self._schedule.at(f.mb.id)], "timeout_s", 60.0) for f in heads)
        deadline = time.monotonic() + timeout
        while not any(all(fu.done() for fu in f.futures) for f in heads):
            pending = [fu for f in heads for fu in f.futures if not fu.done()]
            done, _ = concurrent.futures.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"no stage answered within {timeout} s")
        landed: list[_Flight] = []
        moved = True
        while moved:  # each stage's queue in order: a micro-batch passes after the ones before it
            moved = False
            for mb in self._schedule.in_flight:
                flight = self._flights[mb.id]
                s = self._schedule.at(mb.id)
                if (flight.futures is None or self._schedule.queue(s)[0].id != mb.id
                        or not all(fu.done() for fu in flight.futures)):
                    continue
                flight.x, flight.futures = [fu.result() for fu in flight.futures], None
                moved = True
                if self._schedule.passed(mb.id):
                    landed.append(self._flights.pop(mb.id))
                break
        return landed

    def _abandon(self) -> None:
        """A stage failed mid-step: nothing stays in flight (the rows' KV there is lost with it);
        the slots of rows cancelled meanwhile are freed."""
        self._schedule.drop()
        self._flights.clear()
        for req in self._closing.values():
            self._close(req)
        self._closing.clear()

    def _fork(self, req: _Request) -> list[_Request]:
        forks, req.forks = req.forks, []
        for f in forks:
            for stage in self.stages:
                stage.fork(req.key, f.key, len(req.prompt_ids))
            f.parent = None
        req.pending, req.tail = req.tail, []
        return forks

    def _prefill_passes(self, budget: int, waiting: list[_Request] | None = None, parts: int | None = None
                        ) -> list[_Pass]:
        """Prompt chunks within `budget` tokens, batched: the requests waiting for prefill go
        through together, a pass taking the next `n` tokens of each of its rows, `n` the
        shortest remainder (a pass reads every weight once, so a burst of prompts costs a few
        passes, not one per request; rows never need padding), cut into one micro-batch per
        stage when stages run elsewhere. A request gets one chunk a step
        (as before: its chunks never overlap in a pipeline's stages); in admission order."""
        passes: list[_Pass] = []
        if waiting is None:
            waiting = [r for r in self._active.values() if r.pending and r.parent is None]
        while waiting and budget > 0:
            n = min(self.prefill_chunk, *(len(r.pending) for r in waiting))
            rows = waiting[: max(1, budget // n)]
            n = min(n, budget)
            budget -= n * len(rows)
            # In a pipeline the rows go as one micro-batch per stage, so the stages compute at
            # once (2D pipelining) instead of taking turns on one big pass.
            for group in _split(rows, self.micro_batches if parts is None else parts):
                chunks = []
                for req in group:
                    chunk, req.pending = req.pending[:n], req.pending[n:]
                    chunks.append(chunk)
                # A fresh prompt, once in, gives the first token at its last position. (A resumed
                # request's last token is still to be fed: it decodes on the next step.)
                passes.append(_Pass(group, torch.tensor(chunks, device=self.device), n,
                                    sample=tuple(not r.pending and not r.output_ids for r in group), prefill=True))
            waiting = [r for r in waiting if r.pending and r not in rows]  # one chunk a request a step
        return passes

    def _forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int) -> torch.Tensor:
        x = inputs
        last = len(self.stages) - 1
        for i, stage in enumerate(self.stages):
            x = stage.forward(request_ids, x, q_len, logits_to_keep=1 if i == last else 0)
        return x

    def _run_passes(self, passes: list[_Pass]) -> list[torch.Tensor]:
        """Every pass through every stage, one after the other (every stage is here: a pipeline
        with stages elsewhere keeps its micro-batches in flight instead, _step_pipelined)."""
        if self._front is not None:  # a live pair's source: one local stage
            return self._run_paired(passes)
        return [self._forward(p.ids, p.inputs, p.q_len) for p in passes]

    # -- live pair (BlitzScale §5.2) -----------------------------------------------------------------

    def pair_with(self, front: Front, splitter: Callable[[list[str]], int],
                  on_lost: Callable[[str], None] | None = None) -> None:
        """Offload the first blocks of prefills to a loading target's `front` (see livepair.py).
        `splitter(keys)` gives, once per batch of requests starting their prefill, how many
        blocks that batch runs there (0: here); a request keeps its split for all its chunks.
        `on_lost(error)`: called (on the stepping thread) when the target fails and the engine
        goes on alone."""
        if len(self.stages) != 1 or not isinstance(self.stages[0], LocalStage):
            raise ValueError("a live pair's source serves the whole model in one local stage")
        if self._front is not None:
            raise ValueError("this engine is already in a live pair")
        self._front, self._splitter, self.pair_error, self._on_lost = front, splitter, None, on_lost

    def unpair(self) -> None:
        """The pair ends (dissolved, or the target is gone): every pass runs here from now. A
        prefill split so far keeps its KV (each chunk's front KV is already here); its next
        chunks run every block here."""
        front, self._front, self._splitter = self._front, None, None
        split, self._split_of = self._split_of, {}
        for key, blocks in split.items():
            if blocks and front is not None:
                self._close_front(front, key)

    @property
    def paired(self) -> bool:
        return self._front is not None

    def _run_paired(self, passes: list[_Pass]) -> list[torch.Tensor]:
        """A live pair's source's passes: rows of a prefill grouped by their split; a group with
        k > 0 runs blocks [0, k) on the front, which hands back the hidden state and their KV,
        and [k, n) here over that KV. Every prefill's front is sent first (a remote front
        answers later: `submit`), so the target computes while this engine runs the step's
        decode passes; the source does not wait idle for the blocks it lent out."""
        stage = self.stages[0]
        started: dict[int, tuple[dict[int, list[int]], dict[int, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]] = {}
        for i, p in enumerate(passes):
            if p.prefill and self._front is not None:
                try:
                    started[i] = self._start_split(p)
                except _PAIR_FAILURES as e:
                    self._lost(e)
        out: list[torch.Tensor] = []
        for i, p in enumerate(passes):
            if i in started and self._front is not None:
                try:
                    out.append(self._finish_split(stage, p, *started[i]))
                    continue
                except _PAIR_FAILURES as e:
                    self._lost(e)
            # A decode pass, or the target failed or is gone: the pass runs here. Every chunk already
            # split left its front KV here, so the source's cache is whole up to this pass (nothing
            # half-written: forward_rest writes only after the front answered).
            out.append(self._forward(p.ids, p.inputs, p.q_len))
        return out

    def _lost(self, e: BaseException) -> None:
        log.warning("live pair's target failed (%s): the source runs every block from now", e)
        self.pair_error = str(e)
        self._front, self._splitter, self._split_of = None, None, {}
        if self._on_lost is not None:
            self._on_lost(str(e))

    def _start_split(self, p: _Pass):
        """Split the pass's new prefills, open them on the front, and send each group's front."""
        stage = self.stages[0]
        # Only a prefill from an empty cache splits (the front's KV would miss earlier positions).
        new = [r.key for r in p.requests if r.key not in self._split_of and stage.length(r.key) == 0]
        if new:
            blocks = self._splitter(new)
            if not 0 <= blocks < self.index.n_blocks:
                raise ValueError(f"a live pair splits inside the model: 0 <= k < {self.index.n_blocks}, got {blocks}")
            for key in new:
                self._split_of[key] = 0
                if blocks:
                    self._front.open(key)
                    self._split_of[key] = blocks
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(p.requests):
            groups.setdefault(self._split_of.get(r.key, 0), []).append(i)
        front, submit = self._front, getattr(self._front, "submit", None)
        fronts = {}
        for blocks, rows in groups.items():
            if blocks:
                args = ([p.ids[i] for i in rows], p.inputs[rows], p.q_len, blocks)
                if submit is not None:  # answered later: result() waits for it
                    fronts[blocks] = submit(*args).result
                else:  # a front in this process: computed now
                    done = front.forward(*args)
                    fronts[blocks] = lambda done=done: done
        return groups, fronts

    def _finish_split(self, stage: LocalStage, p: _Pass, groups: dict[int, list[int]], fronts) -> torch.Tensor:
        # Every front's answer first: a target that fails leaves the source's cache untouched by this pass.
        answers = {blocks: result() for blocks, result in fronts.items()}
        out: torch.Tensor | None = None
        for blocks, rows in groups.items():
            ids, x = [p.ids[i] for i in rows], p.inputs[rows]
            if blocks:
                hidden, kv = answers[blocks]
                logits = stage.forward_rest(ids, hidden, p.q_len, kv, blocks, logits_to_keep=1)
            else:
                logits = stage.forward(ids, x, p.q_len, logits_to_keep=1)
            if len(groups) == 1:
                out = logits
                break
            if out is None:
                out = logits.new_empty((len(p.requests), *logits.shape[1:]))
            out[rows] = logits
        for r in p.requests:
            if not r.pending and self._split_of.get(r.key) is not None:  # its prefill is in: the front forgets it
                if self._split_of.pop(r.key):
                    self._close_front(self._front, r.key)
        return out

    @staticmethod
    def _close_front(front: Front, key: str) -> None:
        try:
            front.close(key)
        except Exception as e:  # a target that is gone has nothing left to free
            log.warning("closing %s on a live pair's front failed: %s", key, e)

    def _advance(self, req: _Request, logits: torch.Tensor) -> TokenOutput:
        allowed = req.constraint.allowed() if req.constraint is not None else None
        token = sample_token(logits, req.params, req.generator, req.prompt_ids, req.output_ids, allowed)
        logprob, top = None, ()
        if req.params.logprobs is not None:
            logprob, top = token_logprobs(logits, token, req.params.logprobs)
        req.output_ids.append(token)
        reason: FinishReason | None = None
        if token in req.stop_ids:
            reason = "stop"
        elif req.constraint is not None and (not req.constraint.take(token) or req.constraint.finished):
            reason = "stop"  # the grammar is complete: its text ends on this token (or it refused one)
        elif len(req.output_ids) >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            del self._active[req.key]
            self._close(req)
        return TokenOutput(req.id, token, reason is not None, reason, len(req.prompt_ids), len(req.output_ids),
                           logprob, top, req.choice)

    def _close(self, req: _Request) -> None:
        if self._split_of.pop(req.key, 0) and self._front is not None:  # cancelled mid split prefill
            self._close_front(self._front, req.key)
        if req.started:
            req.started = False
            for stage in self.stages:
                try:
                    stage.close(req.key)
                except Exception as e:  # a stage that is gone (a pipeline's worker) has nothing left to free
                    log.warning("closing %s on a stage failed: %s", req.key, e)


def checkpoint_eos_ids(ckpt_dir: str | os.PathLike, index: CheckpointIndex) -> set[int]:
    """End tokens: config.json's plus generation_config.json's (e.g. the end of a chat turn)."""
    eos = set(_as_id_list(index.config.get("eos_token_id")))
    gen_path = Path(ckpt_dir) / "generation_config.json"
    if gen_path.is_file():
        eos |= set(_as_id_list(json.loads(gen_path.read_text()).get("eos_token_id")))
    return eos


def budgeted_stage(model: LayerRange, max_batch_size: int, max_seq_len: int,
                   kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> LocalStage:
    """A local stage over `model` with as many KV slots as the budget holds (at most max_batch_size)."""
    per_slot = kv_bytes_per_slot(model.config, model.layer_end - model.layer_start, max_seq_len, model.dtype)
    slots = min(max_batch_size, kv_cache_bytes // per_slot)
    if slots < 1:
        raise ValueError(f"a KV budget of {kv_cache_bytes} bytes cannot hold one request of "
                         f"{max_seq_len} tokens ({per_slot} bytes)")
    return LocalStage(model, slots, max_seq_len)


def local_stages(index: CheckpointIndex, blocks: Mapping[int, torch.Tensor], splits: Sequence[int],
                 device: str | torch.device, slots: int, max_seq_len: int) -> list[LocalStage]:
    """The model cut at block ids `splits` into local stages, each with its own KV cache."""
    bounds = [0, *sorted(splits), index.n_blocks]
    if len(set(bounds)) != len(bounds) or bounds != sorted(bounds):
        raise ValueError(f"splits {list(splits)} must be distinct block ids inside 1..{index.n_blocks - 1}")
    return [LocalStage(LayerRange(index, blocks, a, b, device=device), slots, max_seq_len)
            for a, b in zip(bounds, bounds[1:])]
