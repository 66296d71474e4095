"""Tests for choose_multicast (libs/planning/multicast_choice.py)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.planning.multicast import (
    binomial_schedule,
    chain_schedule,
    execution_pipelines,
    kway_schedule,
    kway_subgroups,
    pipeline_ready_steps,
    schedule_steps,
)
from libs.planning.multicast_choice import choose_multicast

GIB = 1 << 30


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_sources=st.integers(min_value=1, max_value=6),
    n_targets=st.integers(min_value=1, max_value=40),
    n_blocks=st.integers(min_value=1, max_value=32),
    live=st.booleans(),
)
def test_predictions_match_the_schedules(n_sources: int, n_targets: int, n_blocks: int, live: bool) -> None:
    c = choose_multicast(n_sources, n_targets, 16 * GIB, n_blocks, 100.0, live, chunk_bytes=None)
    p = c.predictions
    step = 16 * GIB / n_blocks * 8 / 100e9
    # Step counts are those of the schedules the executors would run.
    assert p["binomial"].steps == schedule_steps(binomial_schedule(n_targets + 1, n_blocks))
    k = min(n_sources, n_targets)
    kw = kway_schedule(n_targets + k, n_blocks, k)
    assert p["kway"].k == k and p["kway"].steps == schedule_steps(kw)
    per_chain = -(-n_targets // k)
    chains = [[s, *range(100 + s * per_chain, 100 + s * per_chain + per_chain)] for s in range(k)]
    assert p["chain"].steps == schedule_steps(chain_schedule(chains, n_blocks))
    for pred in p.values():
        assert pred.completion_s == pytest.approx(pred.steps * step)  # block-by-block model
        assert pred.first_capacity_s <= pred.completion_s + 1e-12
        assert pred.first_capacity_s == min(
            pred.first_copy_s, pred.first_pipeline_s if pred.first_pipeline_s is not None else float("inf")
        )
    ready = pipeline_ready_steps(kw, n_blocks, execution_pipelines(kway_subgroups(n_targets + k, k)))
    assert p["kway"].first_pipeline_s == pytest.approx((min(ready) + 1) * step)
    # The choice is the best under its objective.
    key = (lambda x: x.first_capacity_s) if live else (lambda x: x.completion_s)
    assert key(c.chosen) == min(key(x) for x in p.values())
    assert c.objective == ("live" if live else "completion")


def test_live_prefers_kway_pipelines_completion_prefers_chains() -> None:
    # 2 sources, 14 targets, 16 GiB in 16 blocks over 100 Gb/s.
    live = choose_multicast(2, 14, 16 * GIB, 16, 100.0, live=True)
    assert live.algorithm == "kway" and live.k == 2
    assert live.chosen.first_capacity_kind == "pipeline"
    full = choose_multicast(2, 14, 16 * GIB, 16, 100.0, live=False)
    # Chunk-relayed chains finish in ≈ M/B regardless of their length.
    assert full.algorithm == "chain"
    assert full.chosen.completion_s == pytest.approx((16 * GIB + 6 * (1 << 20)) * 8 / 100e9)
    # Capacity appears earlier with k-way than with anything else.
    assert live.chosen.first_capacity_s < full.predictions["chain"].first_capacity_s / 1.5


def test_single_source_binomial_beats_block_chains() -> None:
    c = choose_multicast(1, 63, 8 * GIB, 16, 100.0, live=False, chunk_bytes=None)
    assert c.algorithm == "binomial"  # k = 1: binomial and k-way coincide; binomial wins the tie
    assert c.predictions["binomial"].steps == 16 + 6 - 1
    assert c.predictions["chain"].steps == 16 + 63 - 1


def test_step_overhead_and_validation() -> None:
    a = choose_multicast(2, 6, GIB, 8, 100.0, live=True)
    b = choose_multicast(2, 6, GIB, 8, 100.0, live=True, step_overhead_s=0.01)
    for name in a.predictions:
        assert b.predictions[name].completion_s > a.predictions[name].completion_s
    for bad in (
        dict(n_sources=0, n_targets=1),
        dict(n_sources=1, n_targets=0),
        dict(n_sources=1, n_targets=1, model_bytes=0),
        dict(n_sources=1, n_targets=1, n_blocks=0),
        dict(n_sources=1, n_targets=1, link_gbps=0.0),
    ):
        args = dict(n_sources=1, n_targets=1, model_bytes=GIB, n_blocks=4, link_gbps=10.0, live=True)
        args.update(bad)
        with pytest.raises(ValueError):
            choose_multicast(**args)  # type: ignore[arg-type]
