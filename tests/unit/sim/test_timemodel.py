"""libs.sim's time models against their closed forms."""

import pytest

from libs.planning.mesh import Profile
from libs.planning.multicast import build_plan, chain_bound_s, schedule_steps, step_bound_s
from libs.sim.timemodel import Compute, Fabric, Storage, multicast_arrivals
from sim_profile import profile  # noqa: F401  (fixture)

GB = 10**9


def flat(n: int, gbps: float = 8.0, **kw) -> tuple[Fabric, list[str]]:
    nodes = [f"n{i}" for i in range(n)]
    return Fabric(gbps, {w: "leaf-0" for w in nodes}, **kw), nodes


def done(arrivals: dict[str, list[float]]) -> float:
    return max(max(v) for v in arrivals.values())


def test_one_link_is_bytes_over_rate_plus_the_overhead_per_block():
    fabric, nodes = flat(2, gbps=8.0)  # 1 GB/s
    plan = build_plan("binomial", 2, 4, 1)
    arr = multicast_arrivals(plan, nodes, [GB // 4] * 4, fabric, 10.0, step_overhead_s=0.003, chunk_bytes=1 << 20)
    assert arr["n1"] == pytest.approx([10.0 + (b + 1) * (0.25 + 0.003) for b in range(4)])
    assert arr["n0"] == [10.0] * 4  # the source holds every block from the start


@pytest.mark.parametrize("n_nodes,n_blocks", [(8, 4), (16, 16), (5, 8)])
def test_a_binomial_schedule_takes_its_steps_times_one_block(n_nodes, n_blocks):
    fabric, nodes = flat(n_nodes)
    plan = build_plan("binomial", n_nodes, n_blocks, 1)
    arr = multicast_arrivals(plan, nodes, [GB // n_blocks] * n_blocks, fabric, 0.0, step_overhead_s=0.0,
                             chunk_bytes=1 << 20)
    assert done(arr) == pytest.approx(step_bound_s(schedule_steps(plan.schedule), n_blocks, GB, GB))


@pytest.mark.parametrize("n_nodes", [2, 3, 6, 17])
def test_a_chain_relays_cut_through_one_chunk_per_hop(n_nodes):
    fabric, nodes = flat(n_nodes)
    plan = build_plan("chain", n_nodes, 8, 1)
    chunk = 4 << 20
    arr = multicast_arrivals(plan, nodes, [GB // 8] * 8, fabric, 0.0, step_overhead_s=0.0, chunk_bytes=chunk)
    assert done(arr) == pytest.approx(chain_bound_s(n_nodes, GB, chunk, GB))


def test_an_oversubscribed_uplink_slows_only_what_crosses_it():
    nodes = ["a0", "a1", "b0", "b1"]
    leaf = {"a0": "A", "a1": "A", "b0": "B", "b1": "B"}
    plan = build_plan("star", 4, 1, 1)  # a0 sends to each in turn
    fast = multicast_arrivals(plan, nodes, [GB], Fabric(8.0, leaf), 0.0, step_overhead_s=0.0, chunk_bytes=GB)
    slow = multicast_arrivals(plan, nodes, [GB], Fabric(8.0, leaf, uplink_gbps=2.0), 0.0, step_overhead_s=0.0,
                              chunk_bytes=GB)
    inside = [t for t in plan.schedule if leaf[nodes[t.dst]] == "A"]
    assert inside and all(fast[nodes[t.dst]] == slow[nodes[t.dst]] for t in inside
                          if t.step < min(x.step for x in plan.schedule if leaf[nodes[x.dst]] == "B"))
    for w in ("b0", "b1"):  # 1 GB at 2 Gbit/s: 4 s instead of 1 s each
        assert slow[w][0] - fast[w][0] >= 3.0 - 1e-9


def test_a_scaleup_group_has_its_fast_path():
    fabric = Fabric(8.0, {"x": "L", "y": "L", "z": "L"}, {"x": "g", "y": "g", "z": ""}, scaleup_gbps=80.0)
    assert fabric.rate_Bps("x", "y") == pytest.approx(10 * GB)
    assert fabric.rate_Bps("x", "z") == pytest.approx(GB)


def test_disk_then_host_to_device_in_landing_order():
    st = Storage(disk_Bps=2 * GB, disk_latency_s=0.01, h2d_Bps=10 * GB, h2d_latency_s=0.001)
    host = st.disk_reads([GB, GB], 5.0)
    assert host == pytest.approx([5.51, 6.02])
    assert st.to_engine(host, [GB, GB], 5.0) == pytest.approx([5.51 + 0.101, 6.02 + 0.101])
    # blocks already in host memory: the copies run back to back
    assert st.to_engine([0.0, 0.0], [GB, GB], 1.0) == pytest.approx([1.101, 1.202])
    # in the order they land, not block order (a multicast brings each receiver its own order)
    assert st.to_engine([3.0, 1.0], [GB, GB], 0.0) == pytest.approx([3.101, 1.101])


def test_compute_interpolates_the_llm_mesh_profile():
    prof = Profile((1, 1024), (0.01, 0.5), (1, 8), (128, 1024), ((0.02, 0.03), (0.04, 0.08)))
    c = Compute(prof, pipeline_hop_s=0.002)
    assert c.prefill_s(1024) == pytest.approx(0.5)
    assert c.prefill_s(512) == pytest.approx(prof.prefill_time(512))
    assert c.iteration_s(8, 1024) == pytest.approx(0.08)
    assert c.iteration_s(4, 576) == pytest.approx(prof.decode_time(4, 576))
    assert c.iteration_s(1, 128, stages=3) == pytest.approx(0.02 + 2 * 0.002)
    assert c.iteration_s(1, 128, sharing=2) == pytest.approx(0.04)
    assert c.iteration_s(0, 128) == 0.0


def test_a_noisy_profile_extrapolated_never_gets_faster_than_its_last_sample():
    # Measured here under load (simulate --validate's test): times fall with length, so beyond the
    # longest measured length the extended line went to zero; a step of no time froze the
    # simulation, and a TTFT of 0 failed that test in CI. Beyond the samples: never below the last.
    prof = Profile((1, 16), (0.0026, 0.0025), (1, 2), (8, 16), ((0.0027, 0.0022), (0.0027, 0.0026)))
    c = Compute(prof)
    assert prof.decode_time(1, 80) == pytest.approx(0.0022) and c.iteration_s(1, 80) == pytest.approx(0.0022)
    assert c.prefill_s(10_000) == pytest.approx(0.0025)


def test_prompts_waiting_together_share_the_engines_step(profile):
    """The engine's step (libs/engine/engine.py): one decode pass, then one batched prefill pass over
    the waiting prompts, `n` the shortest remainder; a prompt gives its first token at the end of
    the step that finishes it. A arrives alone; B (10 tokens) and C (30) wait together behind it."""
    from libs.sim.fleet import FleetConfig, simulate

    cfg = FleetConfig(nodes=1, mode="ideal", min_instances=1, tick_s=0.25, horizon_after_s=5.0, keep_alive_s=60)
    res = simulate(cfg, profile, [(5.0, 10, 4), (5.001, 10, 4), (5.001, 30, 4)])
    a, b, c = res.requests
    p, d = profile.compute.prefill_time, profile.compute.decode_time
    step1 = 5.0 + p(10)
    step2 = step1 + d(1, 11) + p(2 * 10)  # A decodes, B and C prefill their first 10 tokens
    step3 = step2 + d(2, 11) + p(20)  # A and B decode, C prefills its last 20
    assert a.first_token == pytest.approx(step1)
    assert b.first_token == pytest.approx(step2)
    assert c.first_token == pytest.approx(step3)


def test_the_simulators_engine_step_is_the_engines():
    import libs.engine.engine as engine
    import libs.sim.fleet as fleet
    from libs.engine.engine import DEFAULT_PREFILL_CHUNK, DEFAULT_TOKEN_BUDGET
    from libs.sim.fleet import ENGINE_PREFILL_CHUNK, ENGINE_TOKEN_BUDGET

    assert (ENGINE_TOKEN_BUDGET, ENGINE_PREFILL_CHUNK) == (DEFAULT_TOKEN_BUDGET, DEFAULT_PREFILL_CHUNK)
    # what runs ahead of a load, and in which passes: one module for both (libs.planning.ahead)
    assert engine.ahead_passes is fleet.ahead_passes and engine.passes_to_finish is fleet.passes_to_finish
    assert engine.AHEAD_TOKEN_LIMIT == fleet.AHEAD_TOKEN_LIMIT


def test_each_row_of_an_iteration_pays_the_token_overhead():
    prof = Profile((1, 1024), (0.01, 0.5), (1, 8), (128, 1024), ((0.02, 0.03), (0.04, 0.08)))
    c = Compute(prof, token_overhead_s=0.005)
    assert c.iteration_s(1, 128) == pytest.approx(0.02 + 0.005)
    assert c.iteration_s(8, 1024) == pytest.approx(0.08 + 8 * 0.005)
    assert c.iteration_s(8, 1024, sharing=2) == pytest.approx(2 * (0.08 + 8 * 0.005))
    assert c.prefill_s(1024) == pytest.approx(0.5)  # a prefill pays the request's overhead, not this


def test_a_request_reaches_the_engine_its_overhead_after_it_was_sent(profile):
    """Closed form on a warm instance, one request alone: TTFT = request_overhead + prefill(P);
    each later token one iteration (decode(1, len) + token_overhead)."""
    from libs.sim.fleet import FleetConfig, simulate

    p = profile.with_values(request_overhead_s=0.04, token_overhead_s=0.006)
    cfg = FleetConfig(nodes=1, mode="ideal", min_instances=1, tick_s=0.25, horizon_after_s=5.0, keep_alive_s=60)
    (r,) = simulate(cfg, p, [(5.0, 100, 3)]).requests
    pre, dec = profile.compute.prefill_time, profile.compute.decode_time
    assert r.ttft == pytest.approx(0.04 + pre(100))
    # two more tokens: the decode passes at lengths 101 and 102 (the fluid model's mean length)
    assert r.done - r.first_token == pytest.approx(2 * (dec(1, 101) + 0.006), rel=0.02)
