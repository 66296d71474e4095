"""The fleet simulator drives layercast's own decisions: patching one changes what it simulates."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import libs.planning.autoscale as autoscale_mod
import libs.planning.instance as instance_mod
import libs.planning.scaleop as scaleop_mod
import libs.planning.scaleout as scaleout_mod
from libs.planning.multicast import build_plan, schedule_steps, step_bound_s
from libs.sim.fleet import FleetConfig, Simulation, simulate
from libs.sim.report import summarize
from libs.sim.timemodel import Fabric, multicast_arrivals
from sim_profile import profile  # noqa: F401  (fixture)

# A burst of 40 at t=1 s, then a trickle: short runs (coarse tick, short horizon) for the CI budget.
BURST = [(1.0, 512, 32)] * 100 + [(20.0 + i, 256, 16) for i in range(5)]

BIG_BURST = [(1.0, 512, 32)] * 200


def cfg(mode: str, nodes: int = 8, **kw) -> FleetConfig:
    return FleetConfig(nodes=nodes, mode=mode, **{"tick_s": 0.25, "horizon_after_s": 40.0, "keep_alive_s": 10.0, **kw})


def fingerprint(res):
    return ([(r.rid, r.first_token, r.done, r.lost) for r in res.requests], res.instance_series,
            [sorted(o.items()) for o in res.scale_ops], res.events)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), trace=st.lists(
    st.tuples(st.floats(0, 20), st.integers(1, 2048), st.integers(1, 64)), min_size=1, max_size=25),
    mode=st.sampled_from(["layercast", "binomial", "serverlessllm"]), models=st.integers(1, 2))
def test_a_run_is_deterministic_for_a_seed(profile, seed, trace, mode, models):
    trace = sorted(trace)
    a = simulate(cfg(mode, nodes=4, seed=seed, models=models), profile, trace)
    b = simulate(cfg(mode, nodes=4, seed=seed, models=models), profile, trace)
    assert fingerprint(a) == fingerprint(b)
    assert all(r.done is not None or r.lost for r in a.requests)


def test_the_burst_scales_out_and_serves_everything(profile):
    res = simulate(cfg("layercast"), profile, BURST)
    s = summarize(res, 2.0, 0.25)
    assert s["requests_lost"] == 0 and s["scale_outs"] >= 2
    assert s["max_instances"] == 8  # 100 requests, target 8 in flight per instance: every node


def test_layercast_serves_from_execution_pipelines_while_a_binomial_multicast_runs(profile):
    # 1 -> 15 over 100 Gbit/s: the planner's choice is binomial, whose receivers form pipelines
    res = simulate(cfg("layercast", nodes=16), profile, BIG_BURST)
    ops = [o for o in res.scale_ops if o["algorithm"] == "binomial"]
    assert ops and any(o["pipelines"] for o in ops)
    assert all(r.done is not None for r in res.requests)


def test_the_autoscaling_policy_is_the_load_monitors(profile, monkeypatch):
    monkeypatch.setattr(autoscale_mod, "concurrency_policy", lambda window, cfg, last_request_at=None: 2)
    res = simulate(cfg("layercast"), profile, BURST)
    assert max(n for _, n in res.instance_series) == 2


def test_placement_is_the_planners(profile, monkeypatch):
    monkeypatch.setattr(scaleout_mod, "pick_targets", lambda *a, **kw: [])
    res = simulate(cfg("layercast"), profile, BURST)
    assert not res.scale_ops and all(r.lost for r in res.requests)


def test_pipelines_to_form_are_the_scale_operations(profile, monkeypatch):
    monkeypatch.setattr(scaleop_mod, "pipelines_to_form", lambda *a, **kw: [])
    res = simulate(cfg("layercast", nodes=16), profile, BIG_BURST)
    assert res.scale_ops and not any(o["pipelines"] for o in res.scale_ops)


def test_admission_is_the_instance_lifecycles(profile, monkeypatch):
    real = instance_mod.step

    def refuse(s, ev):
        if isinstance(ev, instance_mod.RequestAdmitted):
            return s, [instance_mod.Refuse("no", code="unavailable")]
        return real(s, ev)

    monkeypatch.setattr(instance_mod, "step", refuse)
    res = simulate(cfg("layercast"), profile, BURST)
    assert all(r.first_token is None for r in res.requests)


def test_ideal_binomial_and_serverlessllm_scale_as_their_modes_say(profile):
    ideal = simulate(cfg("ideal"), profile, BURST)
    assert all(o["first_capacity_s"] < 0.05 for o in ideal.scale_ops)  # control plane only
    binomial = simulate(cfg("binomial"), profile, BURST)
    for o in binomial.scale_ops:  # stop-the-world: serving once every block is in
        assert o["first_capacity_s"] == pytest.approx(o["first_loaded_s"], abs=0.01)
    sllm = simulate(cfg("serverlessllm"), profile, BURST)
    first = sllm.scale_ops[0]  # nothing in host memory: the disk, then the copies to the device
    disk = 1e9 / 2e9 + 1e9 / 32 / 20e9
    assert disk < first["last_loaded_s"] < disk + 0.1
    assert max(o["last_loaded_s"] for o in binomial.scale_ops) < first["last_loaded_s"]



@pytest.mark.parametrize("host_keep_alive_s, second_is_cold", [(0.5, True), (1000.0, False)])
def test_serverlessllm_host_copy_leaves_after_its_keep_alive(profile, host_keep_alive_s, second_is_cold):
    """The worker pins a load's blocks in host memory and releases them at the instance's stop
    with the scale-in's keep-alive (services/worker/loading.py); only then do they leave. A
    model back after its instance stopped reads the disk again once that keep-alive ran out."""
    res = simulate(cfg("serverlessllm", nodes=1, keep_alive_s=2.0, serverlessllm_keep_alive_s=host_keep_alive_s),
                   profile, [(1.0, 64, 4), (30.0, 64, 4)])
    first, second = res.scale_ops
    disk = 1e9 / 2e9
    assert first["last_loaded_s"] > disk
    assert (second["last_loaded_s"] > disk) is second_is_cold
    assert all(r.done is not None for r in res.requests)

def test_a_serve_while_loading_instance_prefills_each_block_as_it_lands(profile):
    """The worker's Engine.prefill_ahead, simulated: a request that reaches a layercast instance
    still loading has only about its last block's share of the prefill left when
    that block lands (each earlier block ran as it came); a stop-the-world (binomial) instance
    runs all of it after its last block."""
    trace = [(1.0, 2048, 4)]
    profile = profile.with_values(h2d_gbytes_per_s=1)  # a 1 s copy into engine memory
    sim = Simulation(cfg("layercast", nodes=1), profile, trace)
    prefill = sim.compute.prefill_s(2048)
    last_share = sim.block_bytes[-1] / sum(sim.block_bytes)
    after = {}
    for mode in ("layercast", "binomial"):
        res = simulate(cfg(mode, nodes=1), profile, trace)
        (op,), (r,) = res.scale_ops, res.requests
        assert op["last_loaded_s"] > 2 * prefill  # the load outlasts the prefill
        after[mode] = r.first_token - (op["decided"] + op["last_loaded_s"])
    assert 0 <= after["layercast"] <= 1.5 * last_share * prefill + 0.002
    assert after["binomial"] >= prefill


# A warm instance, then a burst; 1 GB over 2 Gbit/s links: a chain target's load (4 s) outlasts the
# 2 s TTFT SLO, so the planner pairs the serving instance with the slowest target (BlitzScale §5.2).
WARM_BURST = [(11.0, 512, 32)] * 100


def test_blitzscale_live_pairs_run_the_first_blocks_of_prefills_on_the_loading_target(profile):
    slow = profile.with_values(link_gbps=2)
    res = simulate(cfg("blitzscale", min_instances=1), slow, WARM_BURST)
    assert all(o["algorithm"] in ("chain", "local-load") for o in res.scale_ops)
    assert res.pairs["formed"] >= 1 and res.pairs["refused"] == 0
    on_target = [k for k in res.pairs["splits"] if k > 0]
    assert on_target and max(on_target) <= slow.n_blocks // 2  # the splitter's cap: half the model
    assert all(r.done is not None for r in res.requests)
    # ZigZag's split grows with the blocks the target holds; "fixed" keeps each pair's first one
    fixed = simulate(cfg("blitzscale-fixed", min_instances=1), slow, WARM_BURST)
    assert fixed.pairs["formed"] >= 1 and fixed.pairs["splits_by_pair"]
    assert all(len({k for k in ks if k > 0}) <= 1 for ks in fixed.pairs["splits_by_pair"].values())
    assert len(set(on_target)) > 1
    nopairs = simulate(cfg("blitzscale-nopairs", min_instances=1), slow, WARM_BURST)
    assert nopairs.pairs == {"formed": 0, "refused": 0, "splits": [], "splits_by_pair": {}}


def test_the_split_is_the_real_prefill_splitters(profile, monkeypatch):
    import libs.planning.livepair as livepair_mod

    monkeypatch.setattr(livepair_mod.PrefillSplitter, "__call__", lambda self, ids=(): 0)
    res = simulate(cfg("blitzscale", min_instances=1), profile.with_values(link_gbps=2), WARM_BURST)
    assert res.pairs["formed"] >= 1 and res.pairs["splits"] and not any(res.pairs["splits"])


def test_the_threshold_policy_gets_the_profiled_capacity_and_does_not_flap(profile):
    # capacity_tps: 64 output tokens per request, each request its prefill (96 tokens: 0.01 + 95/511 x 0.03 s)
    # plus 64 full-batch iterations (8 at length 96 + 32 = 128: 0.03 s) shared by 8
    sim = Simulation(cfg("blitzscale-nopairs"), profile, [(0.0, 96, 64)])
    per_request = 0.01 + 95 / 511 * 0.03 + 64 * 0.03 / 8
    assert sim.models["model-0"].policy_params["capacity_tps"] == pytest.approx(64 / per_request)
    # a steady 256 output tokens/s against 0.8 x 250 per instance: two instances, once; with the tokens
    # read per 0.1 s tick at the batches' own events (neither advanced to the tick nor averaged over the
    # gateway's 0.5 s report) the policy saw zero-load ticks and scaled out ~30 times
    steady = [(i * 0.25, 256, 64) for i in range(240)]
    res = simulate(cfg("blitzscale-nopairs", horizon_after_s=20.0), profile, steady)
    s = summarize(res, 2.0, 0.25)
    assert s["max_instances"] == 2 and s["scale_outs"] <= 3


def test_dedicated_sharing_unloads_another_models_instance_before_a_load(profile):
    # two models on one node: dedicated serves them in turn (unloading), exclusive side by side
    trace = [(1.0 + 2 * i, 256, 16) for i in range(10)]
    ded = simulate(cfg("layercast", nodes=1, models=2, sharing="dedicated", seed=3), profile, trace)
    exc = simulate(cfg("layercast", nodes=1, models=2, sharing="exclusive", seed=3), profile, trace)
    assert {r.model for r in ded.requests} == {"model-0", "model-1"}
    assert ded.evicted >= 1 and exc.evicted == 0
    assert all(r.done is not None for r in ded.requests + exc.requests)
    assert len(ded.scale_ops) > len(exc.scale_ops)  # a load each time the node changes model


def test_a_1_to_64_binomial_of_a_13b_model_at_200g_is_within_1_1x_its_bound():
    fabric = Fabric(200.0, {f"n{i}": "leaf-0" for i in range(65)})
    plan = build_plan("binomial", 65, 16, 1)
    size = 26_000_000_000
    arr = multicast_arrivals(plan, list(fabric.leaf_of), [size // 16] * 16, fabric, 0.0,
                             step_overhead_s=scaleout_mod.STEP_OVERHEAD_S, chunk_bytes=4 << 20)
    bound = step_bound_s(schedule_steps(plan.schedule), 16, size, 200e9 / 8)
    assert bound <= max(max(v) for v in arr.values()) <= 1.1 * bound


def test_bad_configs_are_refused(profile):
    with pytest.raises(ValueError, match="unknown scaling mode"):
        FleetConfig(nodes=4, mode="nope")
    with pytest.raises(ValueError, match="sharing"):
        FleetConfig(nodes=4, mode="layercast", sharing="x")
    with pytest.raises(ValueError, match="leaves"):
        FleetConfig(nodes=2, mode="layercast", leaves=3)
    assert profile.max_batch == 8


def test_the_parameter_pool_keeps_a_host_copy_off_the_serving_worker(profile):
    """The planner's pool check (libs.planning.pool): once an instance serves where the only host
    copy is, a copy is sent to another worker over the fabric, so a scale-out from one instance has
    two sources (the real `bench scale` waits for it before deciding). serverlessllm keeps no pool."""
    res = simulate(cfg("layercast", nodes=4, min_instances=1, keep_alive_s=1e9), profile, [(20.0, 128, 4)])
    (fill,) = res.pool_fills
    assert fill["from_peers"] == profile.n_blocks and fill["done_s"] > fill["sent_s"]
    assert fill["worker"] != "w0000"  # the deploy's copy is there, and the first instance loads from it
    assert all(r.done is not None for r in res.requests)
    assert simulate(cfg("serverlessllm", nodes=4, min_instances=1), profile, [(20.0, 128, 4)]).pool_fills == []


def test_a_loading_instance_finishes_its_first_prompts_before_the_rest_of_a_batch_run_ahead(profile):
    """More prompts wait at a loading instance than its compute can run ahead: the first admitted
    pass runs through each landed block before later passes do, and the steps after the load
    finish the passes a budget at a time, those as far along as the first (libs.planning.ahead):
    the first prompts' tokens come their last block's compute after the load, the rest later."""
    trace = [(1.0, 1024, 4)] * 16
    profile = profile.with_values(h2d_gbytes_per_s=2, max_batch=16)  # a 0.5 s copy into engine memory
    sim = Simulation(cfg("layercast", nodes=1), profile, trace)
    one = sim.compute.prefill_s(1024)
    res = simulate(cfg("layercast", nodes=1), profile, trace)
    (op,) = res.scale_ops
    loaded = op["decided"] + op["last_loaded_s"]
    firsts = sorted(r.first_token for r in res.requests)
    assert sim.compute.prefill_s(16 * 1024) > op["last_loaded_s"]  # more than the load can hide
    # the passes caught up have only their last block left: a few of those, not one whole prefill
    assert 0 <= firsts[0] - loaded < 0.25 * one
    assert firsts[-1] - firsts[0] > one  # the others' prefills come after
