"""LLM-Mesh's decisions for many models sharing workers, as pure functions (llm-mesh.txt).

- §5.2 performance quantification: :class:`Profile`, prefill time by 1-D linear interpolation
  over prompt lengths, decode-iteration time by 2-D interpolation over batch size x mean
  sequence length, sampled at powers of two (:func:`sample_points`).
  A profile is refreshed from live iterations (:func:`refreshed`): each observation pulls the
  samples around it toward what it saw, never past it.
- §5.1 headroom (eq. 1) and token-level scheduling: each iteration goes to the instance that
  holds the request with the least headroom (:func:`next_instance`).
- §5.3 shadow validation: a request joins an instance only if a simulated future of the node
  (every iteration overestimated by a margin, 10% as the paper) has none of Fig. 6's three
  failures (:func:`shadow_validate`).
- §6.1-6.2 KV demand (eq. 2) and watermark resizing: scale up early to M_require*(1+w), down
  lazily (:func:`kv_require`, :func:`kv_resize`); §6.4 the compromise to M_require
  (:func:`kv_grant`) and the eviction of the request with the longest headroom.
- §6.3 hazard-aware orchestration of memory operations: an optimistic budget decides whether
  an operation may be issued, a pessimistic tracking whether it may start now; a scale-up that
  could overrun memory waits in a reservation station until a scale-down completes
  (:class:`MemoryState`, :func:`issue`, :func:`complete`); an operation that failed is taken
  back (:func:`abort`), refusing the waiting scale-ups a failed scale-down would have made room for.
  :func:`kv_fit` is the KV size an instance with slot-granular KV should have (eq. 2, §6.2, §6.4).
- §7 defragmentation: the neighbours an instance preempts when a request fails validation
  (smaller batches, smallest first, only those whose requests can still meet their SLOs
  elsewhere: :func:`plan_preemption`) and bin-packing order (largest batch first), CPU workers
  before GPU workers.

No I/O; time is passed in.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "DEFAULT_TPOT_SLO_S",
    "MARGIN",
    "MemOp",
    "MemoryState",
    "abort",
    "MeshInstance",
    "Profile",
    "ResizeCost",
    "RunningRequest",
    "Validation",
    "bin_packing_key",
    "can_move",
    "candidate_order",
    "complete",
    "default_ttft_slo",
    "eviction_victim",
    "issue",
    "kv_fit",
    "kv_grant",
    "kv_require",
    "kv_resize",
    "most_urgent",
    "next_instance",
    "plan_preemption",
    "preemption_candidates",
    "profile_samples",
    "refreshed",
    "sample_points",
    "shadow_validate",
    "simulate",
]

MARGIN = 0.10  # §5.3: each simulated iteration is overestimated by 10%
DEFAULT_TPOT_SLO_S = 0.25  # §8: the paper's TPOT SLO


def default_ttft_slo(prompt_len: int) -> float:
    """§8: the TTFT SLO grows with the prompt, max(2, L/512) seconds."""
    return max(2.0, prompt_len / 512)


# --- §5.2 performance quantification ------------------------------------------------------------


def sample_points(maximum: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `maximum` (included): O(log) samples per dimension."""
    if maximum < 1:
        raise ValueError(f"maximum must be >= 1, got {maximum}")
    points = [1 << i for i in range(maximum.bit_length()) if 1 << i <= maximum]
    return tuple(points if points[-1] == maximum else [*points, maximum])


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), xs ascending: the two closest known points. Below the
    first point, the first value (a shorter input is never slower); beyond the last, the last
    segment extended (work keeps growing), never below the last value (a longer input is never
    faster: a noisy profile whose last segment falls would otherwise reach 0)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(0.0, y if x <= x1 else max(y, y1))


@dataclass(frozen=True)
class Profile:
    """One model on one device kind: measured prefill and decode-iteration times (seconds)."""

    prefill_lengths: tuple[int, ...]
    prefill_s: tuple[float, ...]
    batches: tuple[int, ...]  # S_B
    lengths: tuple[int, ...]  # S_L: mean sequence length of the batch
    decode_s: tuple[tuple[float, ...], ...]  # decode_s[i][j]: batches[i] requests of mean length lengths[j]

    def __post_init__(self):
        for name, xs in (("prefill_lengths", self.prefill_lengths), ("batches", self.batches),
                         ("lengths", self.lengths)):
            if not xs or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"{name} must be non-empty and strictly ascending, got {xs}")
        if len(self.prefill_s) != len(self.prefill_lengths):
            raise ValueError("one prefill time per prefill length")
        if len(self.decode_s) != len(self.batches) or any(len(r) != len(self.lengths) for r in self.decode_s):
            raise ValueError("decode_s must be len(batches) rows of len(lengths) times")
        if any(t < 0 or not math.isfinite(t) for t in (*self.prefill_s, *(t for r in self.decode_s for t in r))):
            raise ValueError("times must be finite and >= 0")

    def prefill_time(self, prompt_len: int) -> float:
        return _interp(self.prefill_lengths, self.prefill_s, prompt_len)

    def decode_time(self, batch: int, mean_len: float) -> float:
        """Bilinear between the four closest samples: along the lengths in each batch row, then
        along the batches."""
        if batch <= 0:
            return 0.0
        by_batch = [_interp(self.lengths, row, mean_len) for row in self.decode_s]
        return _interp(self.batches, by_batch, batch)


def _bracket(xs: Sequence[int], x: float) -> tuple[tuple[int, float], ...]:
    """The samples :func:`_interp` reads at `x`, each with its share of a correction there: the
    interpolation weights inside; below the first sample, the first alone (its value is used
    as it is); beyond the last, the last two both in full (scaling both scales the extended
    segment by exactly as much, so an extrapolated prediction moves no further than asked)."""
    if len(xs) == 1 or x <= xs[0]:
        return ((0, 1.0),)
    if x >= xs[-1]:
        return ((len(xs) - 2, 1.0), (len(xs) - 1, 1.0))
    i = bisect.bisect_left(xs, x)
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ((i - 1, 1.0 - w), (i, w))


MAX_CORRECTION = 4.0  # one observation moves a sample by at most this factor (outliers: a GC pause)


def _corrected(value: float, weight: float, ratio: float, rate: float) -> float:
    return value * (1.0 + rate * weight * (ratio - 1.0))


def profile_samples(steps: Iterable[tuple[int, float, int, int, float]]
                    ) -> tuple[list[tuple[int, float, float]], list[tuple[int, float]]]:
    """Live engine steps as (decode rows, their mean sequence length, prefill tokens, prefill
    rows, seconds) -> the (decodes, prefills) :func:`refreshed` takes: a step of decodes alone
    is a decode sample, a step prefilling one prompt alone a prefill sample; a mixed step (or a
    batched prefill) is no single sample point: left out."""
    decodes, prefills = [], []
    for rows, mean_len, prefill_tokens, prefill_rows, seconds in steps:
        if prefill_tokens == 0 and rows > 0:
            decodes.append((rows, mean_len, seconds))
        elif rows == 0 and prefill_rows == 1 and prefill_tokens > 0:
            prefills.append((prefill_tokens, seconds))
    return decodes, prefills


def refreshed(profile: Profile, decodes: Iterable[tuple[int, float, float]] = (),
              prefills: Iterable[tuple[int, float]] = (), rate: float = 0.2) -> Profile:
    """§5.2 "refreshed from live measurements": `profile` after observing decode iterations
    (batch, mean sequence length, seconds) and prefills (prompt length, seconds).

    Each observation scales the samples interpolation reads there toward its ratio to the
    prediction, in proportion to their share and `rate` (0 < rate <= 1): at a sample point, or
    beyond the samples, the prediction moves `rate` of the way to the observation; between
    samples by less, never past it; an observation equal to the prediction changes nothing.
    Ratios are clamped to [1/MAX_CORRECTION, MAX_CORRECTION]."""
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    prefill = list(profile.prefill_s)
    for length, seconds in prefills:
        predicted = _interp(profile.prefill_lengths, prefill, length)
        if predicted > 0 and seconds >= 0 and math.isfinite(seconds):
            ratio = min(MAX_CORRECTION, max(1 / MAX_CORRECTION, seconds / predicted))
            for i, w in _bracket(profile.prefill_lengths, length):
                prefill[i] = _corrected(prefill[i], w, ratio, rate)
    decode = [list(row) for row in profile.decode_s]
    for batch, mean_len, seconds in decodes:
        if batch <= 0:
            continue
        predicted = _interp(profile.batches, [_interp(profile.lengths, row, mean_len) for row in decode], batch)
        if predicted > 0 and seconds >= 0 and math.isfinite(seconds):
            ratio = min(MAX_CORRECTION, max(1 / MAX_CORRECTION, seconds / predicted))
            for i, wb in _bracket(profile.batches, batch):
                for j, wl in _bracket(profile.lengths, mean_len):
                    decode[i][j] = _corrected(decode[i][j], wb * wl, ratio, rate)
    return replace(profile, prefill_s=tuple(prefill), decode_s=tuple(tuple(r) for r in decode))


# --- §5.1 headroom and token-level scheduling ------------------------------------------------------


@dataclass(frozen=True)
class RunningRequest:
    id: str
    start: float  # ST: when it arrived
    prompt_len: int
    generated: int = 0  # O: tokens out so far; 0 = its prefill is still to run
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    movable: bool = True  # may be preempted (§7.1); a request moved once already stays where it is

    def deadline(self) -> float:
        """When its next token is due: ST + TTFT_SLO + TPOT_SLO * O."""
        return self.start + self.ttft_slo_s + self.tpot_slo_s * self.generated

    def headroom(self, now: float) -> float:
        """Eq. (1): how long its next token may still wait."""
        return self.deadline() - now


@dataclass(frozen=True)
class MeshInstance:
    id: str
    model: str
    profile: Profile
    requests: tuple[RunningRequest, ...] = ()
    device: str = "cpu"
    token_budget: int = 2048  # tokens an engine step computes at most (libs.engine's default)

    @property
    def batch(self) -> int:
        return len(self.requests)

    def least_headroom(self, now: float) -> float:
        return min((r.headroom(now) for r in self.requests), default=math.inf)

    def iteration(self) -> tuple[float, tuple[str, ...]]:
        """The next iteration's time and the requests it gives a token, as the engine steps: one
        decode over every request past its prefill, plus one batched prefill of the requests
        still waiting for one, in arrival order while their prompts fit the step's token budget
        (the first always; prefill and decode times are profiled apart and add up)."""
        decoding = [r for r in self.requests if r.generated > 0]
        waiting = sorted((r for r in self.requests if r.generated == 0), key=lambda r: (r.start, r.id))
        seconds, served = 0.0, [r.id for r in decoding]
        if decoding:
            mean_len = sum(r.prompt_len + r.generated for r in decoding) / len(decoding)
            seconds = self.profile.decode_time(len(decoding), mean_len)
        prefill, budget = 0, self.token_budget - len(decoding)
        for r in waiting:
            if prefill and prefill + r.prompt_len > budget:
                break
            prefill += r.prompt_len
            served.append(r.id)
        if prefill:
            seconds += self.profile.prefill_time(prefill)
        return seconds, tuple(served)

    def decode_time(self) -> float:
        """One decode iteration over every request, as if all were past their prefill."""
        if not self.requests:
            return 0.0
        mean_len = sum(r.prompt_len + max(r.generated, 1) for r in self.requests) / len(self.requests)
        return self.profile.decode_time(len(self.requests), mean_len)


def next_instance(instances: Iterable[MeshInstance], now: float) -> str | None:
    """§5.1: the instance that runs the next iteration, the one holding the most urgent request
    (ties by id, so the order is deterministic); None when no instance has work."""
    return most_urgent({i.id: i.requests for i in instances}, now)


def most_urgent(requests: Mapping[str, Iterable[RunningRequest]], now: float) -> str | None:
    """:func:`next_instance` over plain (instance id -> its requests): what a worker's engine
    thread knows without profiles."""
    least = {k: min((r.headroom(now) for r in rs), default=math.inf) for k, rs in requests.items()}
    busy = [k for k, h in least.items() if h < math.inf]
    return min(busy, key=lambda k: (least[k], k)) if busy else None


@dataclass(frozen=True)
class Late:
    instance: str
    request: str
    lateness_s: float


def simulate(instances: Sequence[MeshInstance], now: float, *, until_tokens: dict[str, int] | None = None,
             margin: float = MARGIN, max_iterations: int = 10_000, stall_s: float = 0.0) -> tuple[Late, ...]:
    """Run the node's token-level schedule forward in time (each iteration `1 + margin` times its
    profile) and return every token that came after its deadline (first lateness per request).
    Stops once each request in `until_tokens` has that many tokens (default: every request two
    more), or after `max_iterations`. `stall_s`: the node computes nothing for that long first
    (a KV resize holding its engine thread)."""
    state = {i.id: i for i in instances}
    goal = until_tokens if until_tokens is not None else {
        r.id: r.generated + 2 for i in instances for r in i.requests}
    late: dict[str, Late] = {}
    t = now + stall_s
    for _ in range(max_iterations):
        produced = {r.id: r.generated for i in state.values() for r in i.requests}
        if all(produced.get(rid, math.inf) >= n for rid, n in goal.items()):
            break
        chosen = next_instance(state.values(), t)
        if chosen is None:
            break
        inst = state[chosen]
        seconds, served = inst.iteration()
        t += seconds * (1 + margin)
        updated = []
        for r in inst.requests:
            if r.id in served:
                if t > r.deadline() and r.id not in late:
                    late[r.id] = Late(chosen, r.id, t - r.deadline())
                r = replace(r, generated=r.generated + 1)
            updated.append(r)
        state[chosen] = replace(inst, requests=tuple(updated))
    return tuple(late.values())


# --- §5.3 shadow validation --------------------------------------------------------------------------


@dataclass(frozen=True)
class Validation:
    ok: bool
    # Fig. 6's three cases: (1) the new request's prefill ends too late; (2) an existing request
    # becomes late because of it; (3) one decode iteration over the whole node exceeds a TPOT SLO.
    case: Literal["new_prefill_late", "existing_late", "node_tpot_exceeded"] | None = None
    detail: str = ""


def shadow_validate(node: Sequence[MeshInstance], target: MeshInstance, new: RunningRequest, now: float,
                    margin: float = MARGIN, stall_s: float = 0.0, overdue: bool = False) -> Validation:
    """Whether `new` may join `target` (one of `node`'s instances, or a new one) on this node:
    simulate the node's future with and without it, up to the new request's first two decoded
    tokens (R5-D1, R5-D2 in Fig. 6), and refuse on any of the three cases. A request that is late
    even without the new one is not held against it. `stall_s`: what joining costs the node
    before its next iteration (growing `target`'s KV cache, §6.2: the copy holds the engine
    thread), counted in the future with the new request only. `overdue`: `new` has already
    waited past its TTFT SLO elsewhere (at the gateway), so no node can make it compliant and
    refusing it for its own lateness (case 1) would only make it later, until it timed out; the
    other two cases still protect the requests running here."""
    joined = replace(target, requests=(*target.requests, new))
    with_new = [joined if i.id == target.id else i for i in node]
    if all(i.id != target.id for i in node):
        with_new.append(joined)
    goal = {r.id: r.generated + 2 for i in node for r in i.requests} | {new.id: new.generated + 3}
    late = simulate(with_new, now, until_tokens=goal, margin=margin, stall_s=stall_s)
    mine = next((x for x in late if x.request == new.id), None)
    if mine is not None and not overdue:
        return Validation(False, "new_prefill_late", f"{new.id} late by {mine.lateness_s:.3f} s")
    before = {x.request for x in simulate(node, now, until_tokens={k: v for k, v in goal.items() if k != new.id},
                                          margin=margin)}
    pushed = [x for x in late if x.request not in before and x.request != new.id]
    if pushed:
        return Validation(False, "existing_late", f"{pushed[0].request} late by {pushed[0].lateness_s:.3f} s")
    aggregate = sum(i.decode_time() for i in with_new) * (1 + margin)
    tightest = min(r.tpot_slo_s for i in with_new for r in i.requests)
    if aggregate > tightest:
        return Validation(False, "node_tpot_exceeded", f"node decode iteration {aggregate:.3f} s > {tightest} s")
    return Validation(True)


def bin_packing_key(device: str, batch: int, instance_id: str) -> tuple[bool, int, str]:
    """The sort key of :func:`candidate_order` (the gateway's mesh routing sorts by it too): CPU
    workers before GPU ones (§4: GPUs stay free for what needs them), then the largest batch
    first (§7.2 bin-packing: small fragments drain and are recycled after keep-alive), then id."""
    return device != "cpu", -batch, instance_id


def candidate_order(instances: Iterable[MeshInstance]) -> list[MeshInstance]:
    """Where to try a model's request first (:func:`bin_packing_key`)."""
    return sorted(instances, key=lambda i: bin_packing_key(i.device, i.batch, i.id))


def preemption_candidates(node: Iterable[MeshInstance], requester: MeshInstance) -> list[MeshInstance]:
    """§7.1: the neighbours `requester` may preempt: smaller batches only, the smallest first (so
    an enlarged instance is never broken up to grow a smaller one)."""
    return sorted((i for i in node if i.id != requester.id and i.batch < requester.batch),
                  key=lambda i: (i.batch, i.id))


def can_move(request: RunningRequest, profile: Profile, now: float, margin: float = MARGIN) -> bool:
    """§7.1's check that a preempted request still meets its SLO after rescheduling: elsewhere it
    first prefills its prompt and the tokens so far again (the hand-over), which its headroom
    must cover with the margin, as shadow validation overestimates every iteration."""
    redo = profile.prefill_time(request.prompt_len + request.generated) * (1 + margin)
    return request.movable and request.headroom(now) >= redo


def plan_preemption(node: Sequence[MeshInstance], target: MeshInstance, new: RunningRequest, now: float,
                    elsewhere: Collection[str], margin: float = MARGIN,
                    stall_s: float = 0.0, overdue: bool = False) -> tuple[MeshInstance, ...]:
    """§7.1 proactive defragmentation: when `new` fails shadow validation on `target`, the
    neighbours whose requests to move elsewhere so that it passes: the fewest of
    :func:`preemption_candidates` (smaller batches than `target`'s, the smallest first), each of
    a model in `elsewhere` (it has an instance on another node to go on at) and with every
    request able to move (:func:`can_move`); () when none make room."""
    movable = [i for i in preemption_candidates(node, target) if i.model in elsewhere and i.requests
               and all(can_move(r, i.profile, now, margin) for r in i.requests)]
    for k in range(1, len(movable) + 1):
        gone = {i.id for i in movable[:k]}
        rest = [replace(i, requests=()) if i.id in gone else i for i in node]
        if shadow_validate(rest, target, new, now, margin, stall_s, overdue).ok:
            return tuple(movable[:k])
    return ()


def eviction_victim(requests: Iterable[RunningRequest], now: float) -> RunningRequest | None:
    """§6.4 last resort: the request with the longest headroom (it can best afford a restart)."""
    return max(requests, key=lambda r: (r.headroom(now), r.id), default=None)


# --- §6.1-6.2, 6.4 elastic KV ------------------------------------------------------------------------


def kv_require(bytes_per_token: int, requests: Iterable[tuple[int, int]], mean_output: float,
               min_tokens: int) -> int:
    """Eq. (2): C * max(sum over requests of I_r + max(O_r, mean output), L_min) bytes, with
    `requests` as (input length, generated so far) pairs."""
    tokens = sum(i + max(o, mean_output) for i, o in requests)
    return int(math.ceil(bytes_per_token * max(tokens, min_tokens)))


def kv_resize(current: int, require: int, watermark: float) -> int:
    """§6.2: the KV size to have: up at once to M_recommend = M_require * (1 + w) when the cache
    is short, down to it only once M_recommend * (1 + w) < current; else unchanged."""
    recommend = int(math.ceil(require * (1 + watermark)))
    if current < require or recommend * (1 + watermark) < current:
        return recommend
    return current


def kv_grant(current: int, require: int, recommend: int, available: int) -> int | None:
    """§6.4: the size a scale-up may go to with `available` bytes free in the budget: the
    recommendation if it fits, else the compromise M_require, else None (the request cannot join)."""
    for size in (recommend, require):
        if size - current <= available:
            return max(size, current)
    return None


def kv_fit(current: int, rows: int, *, slot_bytes: int, watermark: float, min_slots: int, max_slots: int,
           available: int, copies: bool = True) -> int | None:
    """The KV slots an instance should have with `rows` sequences to hold (its running requests'
    choices), now at `current` slots, with `available` bytes free in the memory budget; None when
    a needed scale-up cannot be granted (the request cannot join).

    The cache is slot-granular (a slot holds one sequence of up to max_seq_len tokens), so eq. 2
    is counted in slots: each row's I_r + max(O_r, mean output) fits its one slot, and L_min is
    `min_slots`. Then the watermark rule (`kv_resize`) and the compromise (`kv_grant`), everything
    capped at `max_slots` (the engine's ceiling: more rows wait in its queue). `copies`: a resize
    copies the live KV into a new pool, so old and new are held at once; a growth then needs
    the whole new size free, not only the difference."""
    if slot_bytes <= 0 or max_slots < 1:
        raise ValueError("slot_bytes and max_slots must be positive")
    require = min(kv_require(slot_bytes, [(1, 0)] * rows, 0, max(min_slots, 1)) // slot_bytes, max_slots)
    target = min(max_slots, -(-kv_resize(current * slot_bytes, require * slot_bytes, watermark) // slot_bytes))
    if target <= current:
        return target  # unchanged, or a lazy scale-down
    free = available - (current * slot_bytes if copies else 0)
    granted = kv_grant(current * slot_bytes, require * slot_bytes, target * slot_bytes, free)
    return None if granted is None else granted // slot_bytes


@dataclass(frozen=True)
class ResizeCost:
    """How long a KV resize holds the engine thread: `fixed_s` (allocating the new pool, the
    bookkeeping) plus `per_slot_s` for each live slot whose KV is copied into it. Learned from
    the resizes a worker measures (:meth:`observed`); the prior is pessimistic, so the first
    resizes are admitted with room to spare rather than late."""

    fixed_s: float = 0.005
    per_slot_s: float = 0.002

    def seconds(self, copied_slots: int) -> float:
        return self.fixed_s + self.per_slot_s * max(0, copied_slots)

    def observed(self, copied_slots: int, seconds: float, rate: float = 0.2) -> ResizeCost:
        """Pulled `rate` of the way toward one measured resize: the part of the error the
        estimate had, spread over its two terms in proportion to their shares of it."""
        if not math.isfinite(seconds) or seconds < 0:
            return self
        estimate = self.seconds(copied_slots)
        if estimate <= 0:
            return ResizeCost(seconds, self.per_slot_s)
        pulled = estimate + rate * (seconds - estimate)
        if copied_slots <= 0:  # the estimate was all fixed cost: the per-slot term keeps its value
            return ResizeCost(pulled, self.per_slot_s)
        # By shares, not by the ratio seconds / estimate (it overflows for a subnormal estimate).
        fixed = pulled * (self.fixed_s / estimate)
        return ResizeCost(fixed, max(0.0, pulled - fixed) / copied_slots)


# --- §6.3 hazard-aware orchestration -----------------------------------------------------------------


@dataclass(frozen=True)
class MemOp:
    """A change of one allocation (a model's weights or an instance's KV) from `old` to `new` bytes."""

    id: str
    old: int
    new: int

    @property
    def delta(self) -> int:
        return self.new - self.old


@dataclass(frozen=True)
class MemoryState:
    capacity: int
    budget: int = 0  # optimistic: every allocation at the size it is heading to
    tracked: int = 0  # pessimistic: what may be allocated now (a shrink counts at its old size until done)
    running: tuple[MemOp, ...] = ()
    waiting: tuple[MemOp, ...] = ()  # the reservation station: issued scale-ups that could overrun memory


def issue(state: MemoryState, op: MemOp) -> tuple[MemoryState, bool, tuple[MemOp, ...]]:
    """Issue `op`: (new state, accepted, operations to start now). A shrink is accepted and
    starts at once. A growth is refused when the budget cannot take it (the caller compromises
    or evicts); accepted, it starts now if the pessimistic tracking says memory holds it, else
    it waits in the reservation station."""
    if op.delta <= 0:
        return replace(state, budget=state.budget + op.delta, running=(*state.running, op)), True, (op,)
    if state.budget + op.delta > state.capacity:
        return state, False, ()
    state = replace(state, budget=state.budget + op.delta)
    if state.tracked + op.delta <= state.capacity:
        return replace(state, tracked=state.tracked + op.delta, running=(*state.running, op)), True, (op,)
    return replace(state, waiting=(*state.waiting, op)), True, ()


def complete(state: MemoryState, op_id: str) -> tuple[MemoryState, tuple[MemOp, ...]]:
    """`op_id` has finished: a shrink releases its memory, and the reservation station starts
    what now fits (in issue order, skipping what still does not: out of order, as Tomasulo)."""
    op = next((o for o in state.running if o.id == op_id), None)
    if op is None:
        raise KeyError(f"no running memory operation {op_id!r}")
    tracked = state.tracked + min(op.delta, 0)
    running = tuple(o for o in state.running if o.id != op_id)
    started, waiting = [], []
    for w in state.waiting:
        if tracked + w.delta <= state.capacity:
            tracked += w.delta
            started.append(w)
        else:
            waiting.append(w)
    return replace(state, tracked=tracked, running=(*running, *started), waiting=tuple(waiting)), tuple(started)


def abort(state: MemoryState, op_id: str) -> tuple[MemoryState, tuple[MemOp, ...], tuple[MemOp, ...]]:
    """`op_id` is taken back (it failed, or its caller gave up): (new state, operations to start
    now, waiting operations refused). The allocation stays at its old size.

    - waiting: it leaves the reservation station, the budget drops its growth;
    - a running growth: what it held is given back (budget and tracking), which may start waiting ones;
    - a running shrink: the memory it was to free stays allocated, so the budget goes back up;
      the waiting growths admitted on that promise are refused, newest first, until the budget
      holds again. Without that a growth could wait for memory that never comes.

    The budget never exceeds capacity, and once no shrink runs nothing waits: the budget is the
    tracking plus what waits (each shrink that still runs counts in the tracking at its old size),
    so within capacity everything waiting fits."""
    if (op := next((o for o in state.waiting if o.id == op_id), None)) is not None:
        waiting = tuple(o for o in state.waiting if o.id != op_id)
        return replace(state, budget=state.budget - op.delta, waiting=waiting), (), ()
    op = next((o for o in state.running if o.id == op_id), None)
    if op is None:
        raise KeyError(f"no memory operation {op_id!r}")
    budget = state.budget - op.delta
    tracked = state.tracked - max(op.delta, 0)
    running = tuple(o for o in state.running if o.id != op_id)
    waiting, refused = list(state.waiting), []
    while budget > state.capacity and waiting:
        refused.append(waiting.pop())
        budget -= refused[-1].delta
    started, still = [], []
    for w in waiting:
        if tracked + w.delta <= state.capacity:
            tracked += w.delta
            started.append(w)
        else:
            still.append(w)
    return (replace(state, budget=budget, tracked=tracked, running=(*running, *started), waiting=tuple(still)),
            tuple(started), tuple(refused))

