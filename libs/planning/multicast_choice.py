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

First-copy and first-pipeline times of binomial and k-way are read off the
actual schedules (:mod:`libs.planning.multicast`), with λScale Alg. 2 over
the plan's sub-groups (for binomial that is one pipeline over all targets).
Ties go to the other objective, then binomial, k-way, chain.  Heterogeneous
links, leaves and interference are what :mod:`libs.planning.chain` handles;
this model deliberately leaves them out.  Typical outcome: chains finish a
full scale-out first, k-way gives live capacity first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from libs.planning.multicast import (
    Transfer,
    arrival_steps,
    binomial_schedule,
    ceil_log2,
    execution_pipelines,
    kway_schedule,
    kway_subgroups,
    pipeline_ready_steps,
)

__all__ = ["MulticastPrediction", "MulticastChoice", "choose_multicast", "CHOICE_ORDER"]

# The algorithms choose_multicast predicts, in tie-break order.
CHOICE_ORDER: tuple[str, ...] = ("binomial", "kway", "chain")

DEFAULT_CHUNK_BYTES = 1 << 20  # the TCP data plane's relay unit (DESIGN: ≈1 MiB)


@dataclass(frozen=True)
class MulticastPrediction:
    algorithm: str
    k: int  # chains for "chain", sub-groups for "kway", 1 for "binomial"
    steps: int
    step_s: float
    completion_s: float
    first_copy_s: float
    first_pipeline_s: float | None  # None when the scheme forms no pipelines
    first_capacity_s: float
    first_capacity_kind: str  # "copy" or "pipeline"


@dataclass(frozen=True)
class MulticastChoice:
    algorithm: str
    k: int
    objective: str  # "live" (earliest capacity) or "completion"
    predictions: dict[str, MulticastPrediction]

    @property
    def chosen(self) -> MulticastPrediction:
        return self.predictions[self.algorithm]


def _first_copy_step(schedule: Sequence[Transfer], n_nodes: int, n_blocks: int, sources: Collection[int]) -> int:
    arr = arrival_steps(schedule, n_nodes, n_blocks, sources)
    best: int | None = None
    for v in range(n_nodes):
        if v in sources:
            continue
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
    """Predict chain / binomial / k-way for one scale-out and pick one.

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

    b = n_blocks
    block_bytes = model_bytes / b
    bytes_per_s = link_gbps * 1e9 / 8.0
    step_s = block_bytes / bytes_per_s + step_overhead_s

    def at(step: int) -> float:  # time at which what holds after `step` holds
        return (step + 1) * step_s

    preds: dict[str, MulticastPrediction] = {}

    # Chain: min(S, T) chains of ⌈T / chains⌉ targets, relayed chunk by chunk.
    chains = min(n_sources, n_targets)
    longest = -(-n_targets // chains)
    g = block_bytes if chunk_bytes is None else min(float(chunk_bytes), block_bytes)
    chain_steps = b + longest - 1
    preds["chain"] = _prediction(
        "chain",
        chains,
        chain_steps,
        (model_bytes + (longest - 1) * g) / bytes_per_s + chain_steps * step_overhead_s,
        model_bytes / bytes_per_s + b * step_overhead_s,
        None,
        step_s,
    )

    # Binomial: one source, one sub-group; Alg. 2 makes its targets one pipeline.
    n_nodes = n_targets + 1
    sched = binomial_schedule(n_nodes, b)
    steps = b + ceil_log2(n_nodes) - 1
    pipe = min(pipeline_ready_steps(sched, b, [list(range(1, n_nodes))]))
    preds["binomial"] = _prediction(
        "binomial", 1, steps, steps * step_s, at(_first_copy_step(sched, n_nodes, b, {0})), at(pipe), step_s
    )

    # k-way: k sources, shifted orders, Alg. 2 pipelines across sub-groups.
    k = min(n_sources, n_targets)
    n_nodes = n_targets + k
    sched = kway_schedule(n_nodes, b, k)
    groups = kway_subgroups(n_nodes, k)
    pipe = min(pipeline_ready_steps(sched, b, execution_pipelines(groups)))
    steps = b + ceil_log2(max(len(grp) for grp in groups) + 1) - 1
    preds["kway"] = _prediction(
        "kway", k, steps, steps * step_s, at(_first_copy_step(sched, n_nodes, b, set(range(k)))), at(pipe), step_s
    )

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
