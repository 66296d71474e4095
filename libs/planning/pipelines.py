"""Execution pipelines during a multicast (λScale §4.3, Alg. 2): which can serve now, and when they retire.

The receivers of a k-way binomial multicast jointly hold the whole model long before any
one of them holds it alone (any algorithm whose schedule does that gets pipelines:
:func:`plan_pipelines`). Alg. 2 groups them into pipelines, one node per sub-group (nodes
in equal positions of differently shifted sub-groups receive complementary chunks first),
the remaining nodes of a single sub-group forming one pipeline. The planner follows the
block arrivals and asks :func:`pipelines_to_form` which of those pipelines can serve now,
with each stage's block range; once every stage worker holds the whole model as a local
instance, :func:`pipelines_to_retire` retires the pipeline (λScale §4.4 mode switch).

Pure: worker ids and block ids in, decisions out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from libs.planning.multicast import MulticastPlan, kway_pipeline_groups, plan_pipeline_groups


@dataclass(frozen=True)
class PipelineStage:
    """A stage worker runs blocks [block_start, block_end)."""

    worker_id: str
    block_start: int
    block_end: int


@dataclass(frozen=True)
class FormedPipeline:
    members: tuple[str, ...]  # the Alg. 2 group it was formed from
    stages: tuple[PipelineStage, ...]  # in block order; the first is the entry (engine, batching, sampling)

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(s.worker_id for s in self.stages)


def multicast_pipelines(nodes: Sequence[str], k: int) -> list[tuple[str, ...]]:
    """Alg. 2's pipelines over a k-way binomial multicast's nodes (the k sources first, as in
    libs.planning.scaleout.plan_nodes): worker ids of each group, in Alg. 2's order."""
    if len(nodes) - k < 1:
        return []
    return [tuple(nodes[i] for i in group) for group in kway_pipeline_groups(len(nodes), k)]


def plan_pipelines(plan: MulticastPlan, nodes: Sequence[str]) -> list[tuple[str, ...]]:
    """The groups of a multicast plan's receivers (worker ids; `nodes` as plan_nodes gives them)
    that may serve as execution pipelines while its blocks arrive: its algorithm's groups of
    two or more, for any algorithm whose schedule lets receivers jointly hold the model before
    each holds it alone (none otherwise: a chain's, a star's, a tree's)."""
    return [tuple(nodes[i] for i in group) for group in plan_pipeline_groups(plan, len(nodes))]


def pipelines_to_form(groups: Sequence[Sequence[str]], holdings: Mapping[str, Collection[int]], n_blocks: int,
                      started: Collection[Sequence[str]] = ()) -> list[FormedPipeline]:
    """The groups that can start serving as a pipeline now.

    A group forms once its workers jointly hold every block, none of them alone holds them
    all (that worker is about to be a local instance: a pipeline would add hops for
    nothing), it has not formed before (`started`: groups already formed, whatever became
    of them), and :func:`stage_cover` finds stages for it (few stages: few activation hops,
    λScale §4.3). `holdings`: worker -> blocks in its engine memory."""
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    done = {tuple(g) for g in started}
    everything = set(range(n_blocks))
    out: list[FormedPipeline] = []
    for group in groups:
        group = tuple(group)
        if group in done or len(group) < 2:
            continue
        held = {w: set(holdings.get(w, ())) & everything for w in group}
        if any(h == everything for h in held.values()):
            continue
        if set().union(*held.values()) != everything:
            continue
        stages = stage_cover(group, held, n_blocks)
        if stages is not None:
            out.append(FormedPipeline(group, stages))
    return out


def stage_cover(workers: Sequence[str], held: Mapping[str, Collection[int]], n_blocks: int
                ) -> tuple[PipelineStage, ...] | None:
    """Stages covering blocks 0..n_blocks-1 in order, each worker at most once over a run of blocks
    it holds (a worker serves one stage of a pipeline); None if there is none.

    Depth-first from block 0, the worker whose held run reaches furthest first (the greedy
    interval cover of multicast.pipeline_stages: fewest stages, fewest activation hops),
    backing off to another worker where one would be needed twice."""
    sets = {w: set(held.get(w, ())) for w in workers}
    dead_ends: set[tuple[int, frozenset]] = set()

    def reach(w: str, start: int) -> int:
        end = start
        while end < n_blocks and end in sets[w]:
            end += 1
        return end

    def cover(start: int, used: frozenset) -> list[PipelineStage] | None:
        if start == n_blocks:
            return []
        if (start, used) in dead_ends:
            return None
        options = sorted(((reach(w, start), -i, w) for i, w in enumerate(workers) if w not in used), reverse=True)
        for end, _, w in options:
            if end == start:
                break
            rest = cover(end, used | {w})
            if rest is not None:
                return [PipelineStage(w, start, end), *rest]
        dead_ends.add((start, used))
        return None

    stages = cover(0, frozenset())
    return tuple(stages) if stages is not None else None


def pipelines_to_retire(pipelines: Mapping[str, Sequence[str]], local_workers: Collection[str]) -> list[str]:
    """The pipelines (id -> stage workers) every stage worker of which now serves the whole
    model as a local instance (`local_workers`): their requests move there (KV recompute)."""
    local = set(local_workers)
    return [pid for pid, workers in pipelines.items() if workers and set(workers) <= local]
