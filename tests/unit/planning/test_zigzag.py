"""Tests for live-pair ZigZag scheduling (libs/planning/zigzag.py, BlitzScale §5.2)."""

import time
from itertools import accumulate

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.planning.livepair import PrefillSplitter
from libs.planning.zigzag import (
    ZigZagQueue,
    best_effort_configs,
    fixed_split_configs,
    simulate_live_pair,
    simulate_zigzag_queue,
    zigzag_ilp,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LOAD_TIMES = [0.0, 0.5, 1.0, 2.0, 3.5, 6.0, 10.0]


def test_fig15_worked_example() -> None:
    """BlitzScale Fig. 15: 7 batches, 7 layers, loading a layer = 6 layer computations.

    Why our absolute numbers differ from the paper's "32 → 22" for request 7:

    * The text fixes best-effort's plan: every batch that starts before layer 2
      lands (requests 1-6) runs (1, 6).  The source alone then has 6 × 6 = 36
      units of work before request 7 can finish, so 32 is impossible for the
      7th of 7 batches queued at t = 0.  We get 42: the source waits 1 unit for
      request 1's first layer, runs requests 1-6 until 37, then request 7's
      five layers (it got (2, 5) because layer 2 landed at t = 6).
    * 7 batches × 7 layers = 49 layer computations on two instances: the last
      batch cannot finish before 24.5 under any schedule, so "22" cannot be
      the 7th of these batches either.  The figure must number or time its
      requests differently from what the text lets us recover.
    * What the text *does* pin down for ZigZag we reproduce exactly: "request
      3's latency is 17 (12 for requests 1 and 2 and 5 for its own)" — request
      1 runs on the source from t = 0 (the paper's latency formula starts the
      source at 0), requests 2 and 3 wait on the target for layer 2 and run
      (2, 5): latencies 7, 12, 17.
    * The improvement on the worst request matches the paper's ≈10 units:
      42 → 33 with ILP (1) including the paper's C3, 42 → 29 with the
      ILP-free queue of Fig. 16 (the paper's printed C3 is conservative for
      late batches; see zigzag_ilp's docstring).
    """
    n, layers, load = 7, 7, 6.0
    be = best_effort_configs(n, layers, load)
    assert be[:6] == [(1, 6)] * 6  # "req 1-6 can only use a (1, 6) pipeline configuration"
    be_lat = simulate_live_pair(be, layers, load)
    assert be_lat == [7.0, 13.0, 19.0, 25.0, 31.0, 37.0, 42.0]

    zz = zigzag_ilp(n, layers, load)
    zz_lat = simulate_live_pair(zz, layers, load)
    assert zz[:3] == [(0, 7), (2, 5), (2, 5)]
    assert zz_lat[:3] == [7.0, 12.0, 17.0]  # request 3 = 12 + 5, as in the text
    assert zz_lat == [7.0, 12.0, 17.0, 21.0, 25.0, 29.0, 33.0]

    exact = simulate_live_pair(zigzag_ilp(n, layers, load, paper_c3=False), layers, load)
    assert max(exact) == 29.0 and sum(exact) <= sum(zz_lat)

    free = simulate_zigzag_queue(n, layers, load)
    assert free.latencies[:3] == [7.0, 12.0, 17.0]
    assert max(free.latencies) == 29.0

    # ZigZag must beat best-effort on the worst request (and on average).
    assert max(zz_lat) < max(be_lat) and max(free.latencies) < max(be_lat)
    assert sum(zz_lat) < sum(be_lat)
    assert max(be_lat) - max(zz_lat) >= 9  # the paper reports a 10-unit gain


def test_ilp_7x7_is_fast() -> None:
    t0 = time.perf_counter()
    zigzag_ilp(7, 7, 6.0)
    assert time.perf_counter() - t0 < 2.0


@FAST
@given(
    n=st.integers(min_value=1, max_value=8),
    layers=st.integers(min_value=1, max_value=8),
    load=st.sampled_from(LOAD_TIMES),
    paper_c3=st.booleans(),
)
def test_ilp_plan_is_realised_by_the_pair(n: int, layers: int, load: float, paper_c3: bool) -> None:
    configs = zigzag_ilp(n, layers, load, paper_c3=paper_c3)
    assert len(configs) == n
    assert all(t + s == layers and 0 <= t <= max(layers - 1, 0) for t, s in configs)  # C1
    lat = simulate_live_pair(configs, layers, load)
    # The ILP's latency formula (batch i ends at Σ_{j≤i} S_j) holds in simulation:
    # the load-limit constraints are exact, the source never waits.
    assert lat == pytest.approx(list(accumulate(s for _, s in configs)))
    # C2: the target finishes batch i's layers before the source starts it.
    for i in range(1, n):
        assert sum(t for t, _ in configs[: i + 1]) <= sum(s for _, s in configs[:i])
    # And it never loses to the naive policy.
    be = simulate_live_pair(best_effort_configs(n, layers, load), layers, load)
    assert sum(lat) <= sum(be) + 1e-9
    assert max(lat) <= max(be) + 1e-9


@FAST
@given(
    n=st.integers(min_value=1, max_value=24),
    layers=st.integers(min_value=1, max_value=16),
    load=st.sampled_from(LOAD_TIMES),
)
def test_ilp_free_queue_beats_best_effort(n: int, layers: int, load: float) -> None:
    run = simulate_zigzag_queue(n, layers, load)
    assert len(run.latencies) == n
    assert all(t + s == layers for t, s in run.configs)
    be = simulate_live_pair(best_effort_configs(n, layers, load), layers, load)
    assert max(run.latencies) <= max(be) + 1e-9
    assert sum(run.latencies) <= sum(be) + 1e-9


def test_best_effort_never_exceeds_half() -> None:
    for t, s in best_effort_configs(30, 9, 0.5):
        assert t <= 4 and t + s == 9
    assert best_effort_configs(3, 1, 1.0) == [(0, 1)] * 3


def test_simulation_basics() -> None:
    # Everything on the source: plain FCFS.
    assert simulate_live_pair([(0, 3)] * 3, 3, 5.0) == [3.0, 6.0, 9.0]
    # Layer 2 arrives at t = 4: the target idles until then.
    assert simulate_live_pair([(2, 1)], 3, 4.0) == [6.0]
    # Whole batch on the target (S = 0) ends when its last layer ends.
    assert simulate_live_pair([(3, 0)], 3, 0.0) == [3.0]
    with pytest.raises(ValueError):
        simulate_live_pair([(2, 2)], 3, 1.0)
    with pytest.raises(ValueError):
        simulate_live_pair([(1, 2)], 3, -1.0)
    assert zigzag_ilp(0, 5, 1.0) == []


def test_queue_priority_and_zigzag() -> None:
    q = ZigZagQueue(n_layers=4, loaded_layers=1)
    for r in "abc":
        q.push(r)
    # Layer 1 only: the target walks the queue in FCFS order.
    assert q.next_for_target() == "a"
    assert q.target_done("a") is False
    assert q.next_for_target() == "b"  # a's next layer is not loaded
    q.target_done("b")
    # Layer 2 lands: the target zigzags back to the earliest request.
    q.set_loaded(2)
    assert q.next_for_target() == "a"
    # The source pulls the earliest request not on the target.
    assert q.pull_for_source() == ("b", 1)
    q.target_done("a")
    assert q.executed("a") == 2
    assert q.pull_for_source() == ("a", 2)
    assert len(q) == 1 and "c" in q


def test_queue_completes_on_target_and_errors() -> None:
    q = ZigZagQueue(n_layers=2, loaded_layers=2)
    q.push(1)
    assert q.next_for_target() == 1
    with pytest.raises(RuntimeError):
        q.next_for_target()
    assert q.target_done(1) is False
    assert q.next_for_target() == 1
    assert q.target_done(1) is True  # all layers ran on the target
    assert len(q) == 0 and q.pull_for_source() is None and q.next_for_target() is None
    with pytest.raises(ValueError):
        q.target_done(1)
    q.push(2)
    with pytest.raises(ValueError):
        q.push(2)
    with pytest.raises(ValueError):
        ZigZagQueue(0)


def test_queue_source_skips_request_on_target() -> None:
    q = ZigZagQueue(n_layers=3, loaded_layers=1)
    q.push("x")
    q.push("y")
    assert q.next_for_target() == "x"
    assert q.pull_for_source() == ("y", 0)
    assert q.pull_for_source() is None  # x is mid-layer on the target
    q.target_done("x")
    assert q.pull_for_source() == ("x", 1)


@pytest.mark.parametrize("paper_c3", [False, True])
@pytest.mark.parametrize("load", [0.0, 1.0, 2.0, 3.5, 6.0])
def test_ilp_is_optimal_against_brute_force(load: float, paper_c3: bool) -> None:
    # Enumerate every configuration the pair can run without the source ever
    # waiting (the ILP's latency model) and compare objectives.
    from itertools import product

    for n in range(1, 4):
        for layers in range(2, 5):
            best = None
            for ts in product(range(layers), repeat=n):
                cfg = [(t, layers - t) for t in ts]
                ideal = list(accumulate(s for _, s in cfg))
                if simulate_live_pair(cfg, layers, load) != pytest.approx(ideal):
                    continue
                if paper_c3 and any(
                    load * (ts[i] - 1) > sum(ts[:i]) + (n - i) * (ts[i] - 1) + 1e-9
                    for i in range(1, n)
                    if ts[i] >= 1
                ):
                    continue
                best = sum(ideal) if best is None else min(best, sum(ideal))
            got = zigzag_ilp(n, layers, load, paper_c3=paper_c3)
            assert sum(accumulate(s for _, s in got)) == best


@given(st.integers(min_value=0, max_value=64), st.integers(min_value=2, max_value=64))
def test_live_pair_split_takes_what_is_loaded_up_to_half(loaded, n_blocks):
    from libs.planning.zigzag import live_pair_split

    t = live_pair_split(loaded, n_blocks)
    assert 0 <= t <= min(loaded, n_blocks // 2)
    assert t == min(loaded, n_blocks // 2)
    assert (t == 0) == (loaded == 0)


def _run_time_configs(splitter: PrefillSplitter, n: int, layers: int, load: float) -> list[tuple[int, int]]:
    """The splits a live pair's source asks `splitter` for, batch after batch, with the target
    running each batch's front as soon as the previous one is done (today's synchronous
    hand-off: one batch in the queue at a time), in the module's time model."""
    t, out = 0.0, []
    for _ in range(n):
        splitter.held(min(layers, int(t / load + 1e-9) + 1) if load else layers)
        k = splitter()
        out.append((k, layers - k))
        t += k
    return out


def test_zigzag_at_run_time_against_a_fixed_split_on_fig15() -> None:
    """Fig. 15's case (7 batches, 7 layers, a layer's load = 6 computations): a fixed split
    (the first batch's best effort, kept) runs (1, 6) seven times; ZigZag's worst batch is lower:
    the run-time splitter (one batch at a time, k growing with the blocks held) by 1 unit, the
    ILP-free queue with the target working ahead (Fig. 16) by 14."""
    n, layers, load = 7, 7, 6.0
    fixed = fixed_split_configs(n, layers, load)
    assert fixed == [(1, 6)] * 7
    fixed_lat = simulate_live_pair(fixed, layers, load)
    assert fixed_lat == [7.0, 13.0, 19.0, 25.0, 31.0, 37.0, 43.0]

    # The worker's splitter, both policies, reproduces the time model's policies.
    assert _run_time_configs(PrefillSplitter(layers, cap=layers // 2, policy="fixed"), n, layers, load) == fixed
    run_time = _run_time_configs(PrefillSplitter(layers, cap=layers // 2), n, layers, load)
    assert run_time == best_effort_configs(n, layers, load)
    assert run_time[-1] == (2, 5)  # layer 2 landed at t = 6: the 7th batch takes it, the fixed split does not
    zigzag_lat = simulate_live_pair(run_time, layers, load)
    assert max(zigzag_lat) == 42.0 < max(fixed_lat)

    queue = simulate_zigzag_queue(n, layers, load)
    assert max(queue.latencies) == 29.0 < max(zigzag_lat)


@FAST
@given(
    n=st.integers(min_value=1, max_value=16),
    layers=st.integers(min_value=2, max_value=16),
    load=st.sampled_from(LOAD_TIMES),
)
def test_zigzag_never_has_a_worse_batch_than_the_fixed_split(n: int, layers: int, load: float) -> None:
    fixed = fixed_split_configs(n, layers, load)
    assert _run_time_configs(PrefillSplitter(layers, cap=layers // 2, policy="fixed"), n, layers, load) == fixed
    worst_fixed = max(simulate_live_pair(fixed, layers, load))
    run_time = _run_time_configs(PrefillSplitter(layers, cap=layers // 2), n, layers, load)
    assert max(simulate_live_pair(run_time, layers, load)) <= worst_fixed + 1e-9
    assert max(simulate_zigzag_queue(n, layers, load).latencies) <= worst_fixed + 1e-9
