"""Choosing a multicast algorithm for a scale-out (layercast's own step).

The papers each argue for one scheme: BlitzScale for serial chains (optimal
for bandwidth-bound broadcast, §5.1), λScale/FaaScale for the binomial pipeline
and its k-way variant, which let execution pipelines over partially loaded
nodes serve early (§4.2-4.3).  :func:`choose_multicast` predicts, for one
scale-out, both quantities that matter and picks per objective:

* ``completion_s`` — when every target holds the whole model (fastest full
  scale-out, ``live=False``);
* ``first_capacity_s`` — when serving capacity first appears on the targets:
  the first complete local copy, or the first execution pipeline (λScale
  Alg. 2 over the plan's sub-groups) whose nodes jointly hold every block
  (earliest live capacity, ``live=True``).

Cost model.  Links are uniform (``link_gbps`` = B), full duplex, single port:
in one step a node sends one block and receives one block, so a block step
lasts τ = (M/b)/B plus a fixed ``step_overhead_s`` (control message, RDMA/TCP
op latency).  Something that holds after step j (0-based) holds at
(j + 1)·(τ + overhead); a plan of s steps completes at s·(τ + overhead) —
the bound (M/B)·(1 + (steps - b)/b) the multicast benchmark compares with.

* binomial — λScale's 1→N scheme from one source (other sources idle):
  b + ⌈log2 (T+1)⌉ - 1 steps.  Every port is busy every step, so forwarding
  is block by block.
* k-way — k = min(S, T) sub-groups with circularly shifted orders (Alg. 1):
  b + ⌈log2 L⌉ - 1 steps, L the largest sub-group including its source.
* chain — min(S, T) chains, targets split evenly, c targets in the longest.
  A chain node forwards exactly the stream it receives to one successor and
  its send port is otherwise idle, so the transport relays it chunk by chunk
  (layercast's TCP data plane forwards ≈1 MiB chunks while receiving the
  next): the fill costs one chunk per hop, not one block, and the chain
  completes at (M + (c-1)·g)/B + (b + c - 1)·overhead with g = min(chunk,
  M/b) (BlitzScale §5.1: chain time is nearly independent of its length).
  ``chunk_bytes=None`` models block-by-block forwarding (b + c - 1 steps,
  the :func:`~libs.planning.multicast.chain_schedule` view).  A chain's first
  target holds a full copy at M/B + b·overhead; chains never form pipelines
  earlier, since every node holds a prefix of its predecessor's blocks.

The candidates are the registry's (:data:`~libs.planning.multicast.MULTICAST_ALGORITHMS`,
each algorithm's ``candidates``: binomial from one source, binomial from every
source under λScale's name "kway", chains from every source), and every time is
read off the schedule the executors would run, timed by the algorithm's cost
model (block steps; chunk relay for chains).  First-pipeline times come only
for algorithms whose schedules let receivers jointly hold the model before each
holds it alone, over their pipeline groups (λScale Alg. 2 over the plan's
sub-groups; for binomial that is one pipeline over all targets).
Ties go to the other objective, then binomial, k-way, chain (``prefer``).  Leaves, scale-up
groups and interference are what :mod:`libs.planning.chain` handles: the planner
(libs.planning.scaleout) plans the chosen chains with it, and feeds this model the median of
the involved workers' measured link rates and a per-step overhead.  Typical outcome: chains finish a
full scale-out first, k-way gives live capacity first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from libs.planning.multicast import (
    MULTICAST_ALGORITHMS,
    ChoiceCandidate,
    MulticastAlgorithm,
    arrival_steps,
    build_plan,
    multicast_algorithm,
    pipeline_ready_steps,
    schedule_steps,
)

__all__ = ["MulticastPrediction", "MulticastChoice", "choose_multicast", "CHOICE_ORDER"]

# What choose_multicast weighs: every registered algorithm's candidates, in tie-break order.
_CANDIDATES: tuple[tuple[MulticastAlgorithm, ChoiceCandidate], ...] = tuple(sorted(
    ((alg, c) for alg in MULTICAST_ALGORITHMS.values() for c in alg.candidates), key=lambda ac: ac[1].prefer))
CHOICE_ORDER: tuple[str, ...] = tuple(c.label for _, c in _CANDIDATES)

DEFAULT_CHUNK_BYTES = 1 << 20  # the TCP data plane's relay unit (DESIGN: ≈1 MiB)


@dataclass(frozen=True)
class MulticastPrediction:
    algorithm: str  # the candidate's label: a registered name or an alias of one ("kway")
    k: int  # sources it sends from: chains for "chain", sub-groups for "kway", 1 for "binomial"
    steps: int
    step_s: float
    completion_s: float
    first_copy_s: float
    first_pipeline_s: float | None  # None when the scheme forms no pipelines
    first_capacity_s: float
    first_capacity_kind: str  # "copy" or "pipeline"


@dataclass(frozen=True)
class MulticastChoice:
    algorithm: str  # the chosen candidate's label (multicast_algorithm() resolves it)
    k: int
    objective: str  # "live" (earliest capacity) or "completion"
    predictions: dict[str, MulticastPrediction]

    @property
    def chosen(self) -> MulticastPrediction:
        return self.predictions[self.algorithm]

    def prediction_for(self, algorithm: str, k: int) -> MulticastPrediction | None:
        """The prediction for a plan of `algorithm` (a name or an alias) from `k` sources; None
        when no candidate is one (the first in tie-break order where two are)."""
        name = multicast_algorithm(algorithm).name
        return next((p for label in CHOICE_ORDER if (p := self.predictions.get(label)) is not None
                     and multicast_algorithm(label).name == name and p.k == k), None)


def _first_copy_step(arr: Sequence[Sequence[int | None]], receivers: Iterable[int]) -> int:
    best: int | None = None
    for v in receivers:
        row = arr[v]
        if any(s is None for s in row):
            continue
        done = max(s for s in row if s is not None)
        best = done if best is None else min(best, done)
    if best is None:  # pragma: no cover - valid schedules complete every target
        raise ValueError("no target ever completes")
    return best


def _prediction(
    name: str,
    k: int,
    steps: int,
    completion_s: float,
    first_copy_s: float,
    first_pipeline_s: float | None,
    step_s: float,
) -> MulticastPrediction:
    if first_pipeline_s is not None and first_pipeline_s < first_copy_s:
        cap_s, kind = first_pipeline_s, "pipeline"
    else:
        cap_s, kind = first_copy_s, "copy"
    return MulticastPrediction(
        algorithm=name,
        k=k,
        steps=steps,
        step_s=step_s,
        completion_s=completion_s,
        first_copy_s=first_copy_s,
        first_pipeline_s=first_pipeline_s,
        first_capacity_s=cap_s,
        first_capacity_kind=kind,
    )


def _predict(alg: MulticastAlgorithm, label: str, k: int, n_targets: int, model_bytes: int, n_blocks: int,
             bytes_per_s: float, step_s: float, step_overhead_s: float, chunk_bytes: int | None
             ) -> MulticastPrediction:
    """One candidate's times, read off the schedule the executors would run and timed by the
    algorithm's cost model."""
    n_nodes = k + n_targets
    schedule = build_plan(alg.name, n_nodes, n_blocks, k).schedule
    steps = schedule_steps(schedule)

    def at(step: int) -> float:  # when what holds after `step` holds
        return alg.cost.done_s(step, n_blocks, model_bytes, bytes_per_s, chunk_bytes, step_overhead_s)

    arr = arrival_steps(schedule, n_nodes, n_blocks, set(range(k)))
    first_pipeline_s = None
    if alg.forms_pipelines:  # Alg. 2's groups (for binomial that is one group of all its targets)
        first_pipeline_s = at(min(pipeline_ready_steps(schedule, n_blocks, alg.pipeline_groups(n_nodes, k))))
    return _prediction(label, k, steps, at(steps - 1), at(_first_copy_step(arr, range(k, n_nodes))),
                       first_pipeline_s, step_s)


def choose_multicast(
    n_sources: int,
    n_targets: int,
    model_bytes: int,
    n_blocks: int,
    link_gbps: float,
    live: bool,
    *,
    step_overhead_s: float = 0.0,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
) -> MulticastChoice:
    """Predict every registered candidate (chain / binomial / k-way) for one scale-out and pick one.

    ``live=True`` picks the earliest first capacity (ties: earlier
    completion), ``live=False`` the earliest completion (ties: earlier first
    capacity).  See the module docstring for the cost model.
    """
    if n_sources < 1:
        raise ValueError(f"n_sources must be >= 1, got {n_sources}")
    if n_targets < 1:
        raise ValueError(f"n_targets must be >= 1, got {n_targets}")
    if model_bytes <= 0:
        raise ValueError(f"model_bytes must be > 0, got {model_bytes}")
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    if not link_gbps > 0:
        raise ValueError(f"link_gbps must be > 0, got {link_gbps}")
    if step_overhead_s < 0:
        raise ValueError("step_overhead_s must be >= 0")
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be > 0 or None")

    bytes_per_s = link_gbps * 1e9 / 8.0
    step_s = model_bytes / n_blocks / bytes_per_s + step_overhead_s  # one block step
    preds = {
        c.label: _predict(alg, c.label, min(n_sources, n_targets) if c.every_source else 1, n_targets, model_bytes,
                          n_blocks, bytes_per_s, step_s, step_overhead_s, chunk_bytes)
        for alg, c in _CANDIDATES
    }

    rank = {name: i for i, name in enumerate(CHOICE_ORDER)}
    if live:
        key = lambda p: (p.first_capacity_s, p.completion_s, rank[p.algorithm])  # noqa: E731
    else:
        key = lambda p: (p.completion_s, p.first_capacity_s, rank[p.algorithm])  # noqa: E731
    best = min(preds.values(), key=key)
    return MulticastChoice(
        algorithm=best.algorithm,
        k=best.k,
        objective="live" if live else "completion",
        predictions=preds,
    )
