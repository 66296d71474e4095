"""Scale-out plans: which multicast moves a model's blocks to new workers, per scaling mode.

A deployment's scaling mode decides how its scale-outs move blocks, so the baselines
run in the same system as layercast:

- ``layercast``: the planner's choice (:func:`~libs.planning.multicast_choice.choose_multicast`,
  fastest completion) among binomial, k-way binomial and chains;
- ``chain`` (BlitzScale): one chain per source over its share of the targets;
- ``binomial`` (λScale): k-way binomial pipeline, k = the number of sources;
- ``faasnet``: a binary tree from one source;
- ``serverlessllm``: no multicast, every target loads from its own host cache or disk;
- ``static``: a fixed number of instances (min_instances), no scaling;
- ``ideal``: every worker holds every block, activation costs nothing (the lower bound).

Nodes of a plan are numbered 0..N-1 with the k sources first (each holds every block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from libs.planning.multicast import (
    Transfer,
    binary_tree_schedule,
    chain_bound_s,
    chain_schedule,
    kway_schedule,
    kway_subgroups,
    schedule_steps,
    star_schedule,
    step_bound_s,
)
from libs.planning.multicast_choice import choose_multicast

ALGORITHMS = ("star", "binary-tree", "chain", "binomial")
SCALING_MODES = ("layercast", "chain", "binomial", "faasnet", "serverlessllm", "static", "ideal")
# Modes whose scale-outs multicast from the workers holding a copy.
MULTICAST_MODES = ("layercast", "chain", "binomial", "faasnet")
# The `serverlessllm` baseline's host cache keeps a stopped model's blocks this long (λScale §2.3
# measured 15 s on multi-tenant hosts; BlitzScale assumes 5 min): the planner's --serverlessllm-keep-alive.
SERVERLESSLLM_KEEP_ALIVE_S = 15.0


@dataclass(frozen=True)
class MulticastPlan:
    algorithm: str
    k: int  # sources: nodes 0..k-1
    schedule: list[Transfer]
    chains: list[list[int]] | None = None  # chain plans: the node runs, sources first


def build_plan(algorithm: str, n_nodes: int, n_blocks: int, k: int) -> MulticastPlan:
    """The schedule of one algorithm over nodes 0..N-1, sources 0..k-1."""
    if algorithm == "star":
        return MulticastPlan(algorithm, 1, star_schedule(n_nodes, n_blocks))
    if algorithm == "binary-tree":
        return MulticastPlan(algorithm, 1, binary_tree_schedule(n_nodes, n_blocks))
    if algorithm == "binomial":
        return MulticastPlan(algorithm, k, kway_schedule(n_nodes, n_blocks, k))
    if algorithm == "chain":
        # BlitzScale: one chain per source over its share of the targets.
        chains = [[i, *group] for i, group in enumerate(kway_subgroups(n_nodes, k))]
        return MulticastPlan(algorithm, k, chain_schedule(chains, n_blocks), chains)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")


def plan_bound_s(plan: MulticastPlan, n_blocks: int, total_bytes: int, rate_bytes_per_s: float,
                 chunk_bytes: int) -> float:
    """The time the plan's structure needs at link rate R (chains relay chunk by chunk)."""
    if plan.chains is not None:
        return max(chain_bound_s(len(c), total_bytes, chunk_bytes, rate_bytes_per_s) for c in plan.chains)
    return step_bound_s(schedule_steps(plan.schedule), n_blocks, total_bytes, rate_bytes_per_s)


def scaleout_plan(mode: str, n_sources: int, n_targets: int, model_bytes: int, n_blocks: int,
                  link_gbps: float) -> MulticastPlan | None:
    """The multicast a scale-out of `mode` runs from `n_sources` full copies to `n_targets`
    new workers; None when the mode does not multicast or there is nothing to send from."""
    if mode not in SCALING_MODES:
        raise ValueError(f"unknown scaling mode {mode!r}; choose from {', '.join(SCALING_MODES)}")
    if mode not in MULTICAST_MODES or n_sources < 1 or n_targets < 1:
        return None
    k = min(n_sources, n_targets)
    if mode == "faasnet":
        return build_plan("binary-tree", n_targets + 1, n_blocks, 1)
    if mode == "chain":
        return build_plan("chain", k + n_targets, n_blocks, k)
    if mode == "binomial":
        return build_plan("binomial", k + n_targets, n_blocks, k)
    choice = choose_multicast(n_sources, n_targets, model_bytes, n_blocks, link_gbps, live=False)
    if choice.algorithm == "chain":
        return build_plan("chain", choice.k + n_targets, n_blocks, choice.k)
    k = choice.k if choice.algorithm == "kway" else 1
    return build_plan("binomial", k + n_targets, n_blocks, k)


def plan_nodes(plan: MulticastPlan, sources: Sequence[str], targets: Sequence[str]) -> list[str]:
    """Worker ids for the plan's nodes: its k sources (the first of `sources`), then the targets."""
    if len(sources) < plan.k:
        raise ValueError(f"the plan needs {plan.k} sources, got {len(sources)}")
    return [*sources[: plan.k], *targets]
