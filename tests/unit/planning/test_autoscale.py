"""Tests for the load-monitor's state machine (libs/planning/autoscale.py)."""

import dataclasses
import math
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.autoscale import (
    POLICIES,
    AutoscaleConfig,
    AutoscaleState,
    Deployment,
    ModelObservation,
    ModelScaleState,
    Observation,
    ScaleDecision,
    check_policy,
    policy_config,
    scale_down_delay,
    step,
)
from libs.planning.policies import (
    ConcurrencyPolicy,
    MetricsSample,
    SloPolicy,
    ThresholdPolicy,
)
from libs.protocol import messages as m

DEP = Deployment(min_instances=0, max_instances=4, keep_alive_s=60.0)


def obs(t: float, in_flight: int, current: int, dep: Deployment = DEP, last: tuple[float, ...] = (),
        name: str = "m", **sample) -> Observation:  # type: ignore[no-untyped-def]
    s = MetricsSample(t=t, ready=current, in_flight=in_flight, **sample)
    return Observation({name: ModelObservation(sample=s, current=current, deployment=dep, last_requests=last)})


def run(state: AutoscaleState, ticks: list[tuple[float, int, int]], dep: Deployment = DEP,
        last: tuple[float, ...] = ()) -> tuple[AutoscaleState, list[tuple[float, ScaleDecision]]]:
    out = []
    for t, in_flight, current in ticks:
        state, decisions = step(state, obs(t, in_flight, current, dep, last), t)
        out += [(t, d) for d in decisions]
    return state, out


# ---------------------------------------------------------------------------
# examples: decisions, reasons, hysteresis
# ---------------------------------------------------------------------------


def test_scale_up_from_zero_with_the_reason_the_service_publishes() -> None:
    state = AutoscaleState(AutoscaleConfig(defaults={"concurrency": {"target": 8}}))
    state, decisions = step(state, obs(100.0, 20, 0), 100.0)
    assert decisions == [ScaleDecision("m", 3, 0, "up", "demand 20 queued or in flight, 0 instance(s)")]
    assert state.models["m"].desired == 3 and state.models["m"].demand == 20
    assert state.models["m"].last_sent == (3, 100.0)


def test_scale_to_zero_after_keep_alive_with_the_idle_reason() -> None:
    state = AutoscaleState()
    dep = Deployment(0, 4, keep_alive_s=60.0)
    state, decisions = step(state, obs(100.0, 0, 1, dep, last=(50.0,)), 100.0)
    assert decisions == []  # 50 s idle: within the keep-alive
    state, decisions = step(state, obs(111.0, 0, 1, dep, last=(50.0,)), 111.0)
    assert decisions == [ScaleDecision("m", 0, 1, "down", "idle for 61.0s (keep-alive 60.0s)")]
    # The newest report of any gateway counts, and it is remembered.
    state, _ = step(AutoscaleState(), obs(1.0, 0, 1, dep, last=(0.5, 0.9)), 1.0)
    state, _ = step(state, obs(1.1, 0, 1, dep), 1.1)
    assert state.models["m"].last_request_at == 0.9


def test_nothing_while_desired_matches_and_a_match_resets_the_resend_rule() -> None:
    state = AutoscaleState(AutoscaleConfig(resend_s=10.0, defaults={"concurrency": {"target": 1}}))
    state, out = run(state, [(0.0, 2, 1), (0.1, 2, 1), (0.2, 2, 2), (0.3, 2, 2)])
    assert [(t, d.desired) for t, d in out] == [(0.0, 2)]
    assert state.models["m"].last_sent is None
    # The instance is gone again: asked for at once, not after resend_s.
    state, out = run(state, [(0.4, 2, 1)])
    assert [(t, d.desired, d.current) for t, d in out] == [(0.4, 2, 1)]


def test_a_lasting_mismatch_is_repeated_every_resend_s() -> None:
    state = AutoscaleState(AutoscaleConfig(resend_s=1.0, defaults={"concurrency": {"target": 1}}))
    ticks = [(i * 0.25, 3, 1) for i in range(9)]  # 0 … 2 s
    _, out = run(state, ticks)
    assert [t for t, _ in out] == [0.0, 1.0, 2.0]


def test_scale_in_waits_out_the_delay_and_a_break_restarts_it() -> None:
    cfg = AutoscaleConfig(scale_down_delay_s=1.0, window_s=0.3, defaults={"concurrency": {"target": 1}})
    # Windows shorter than a tick: the policy follows the latest sample alone.
    dep = Deployment(0, 4, keep_alive_s=60.0, params={"stable_s": 0.05, "panic_s": 0.05})
    # Demand for one instance, three run: the policy wants 1 from t=0.
    ticks = [(i * 0.25, 1, 3) for i in range(4)]  # 0 … 0.75 s: under the delay
    state, out = run(AutoscaleState(cfg), ticks, dep, last=(0.0,))
    assert out == [] and state.models["m"].below_since == 0.0
    # A break (demand for three) at 0.9 s restarts the delay.
    state, out = run(state, [(0.9, 3, 3), (1.0, 1, 3), (1.5, 1, 3), (1.9, 1, 3)], dep, last=(0.0,))
    assert out == [] and state.models["m"].below_since == 1.0
    state, out = run(state, [(2.0, 1, 3)], dep, last=(0.0,))
    assert [(t, d.desired, d.direction) for t, d in out] == [(2.0, 1, "down")]
    assert out[0][1].reason == "idle for 2.0s (keep-alive 60.0s)"


def test_a_deployment_sets_its_own_scale_down_delay() -> None:
    cfg = AutoscaleConfig(scale_down_delay_s=5.0, window_s=0.3, defaults={"concurrency": {"target": 1}})
    windows = {"stable_s": 0.05, "panic_s": 0.05}
    ticks = [(i * 0.1, 1, 3) for i in range(10)]  # the policy wants 1 of 3 from t=0
    # The cluster's delay: nothing within a second.
    _, out = run(AutoscaleState(cfg), ticks, Deployment(0, 4, params=windows), last=(0.0,))
    assert out == []
    # The deployment's own 0.2 s: the scale-in at 0.2 s.
    _, out = run(AutoscaleState(cfg), ticks, Deployment(0, 4, params={**windows, "scale_down_delay_s": 0.2}),
                 last=(0.0,))
    assert [(round(t, 1), d.desired, d.direction) for t, d in out] == [(0.2, 1, "down")]


def test_threshold_keeps_its_sub_second_timeout_under_the_clusters_delay() -> None:
    # The cluster damps concurrency deployments for 5 s; a threshold deployment's own 0.5 s
    # timeout is its whole hysteresis.
    cfg = AutoscaleConfig(scale_down_delay_s=5.0, window_s=10.0)
    dep = Deployment(0, 4, policy="threshold", params={"capacity_tps": 100.0, "scale_down_timeout_s": 0.5})
    assert scale_down_delay(dep, cfg) == 0.0
    assert scale_down_delay(Deployment(policy="slo", params={"ttft_slo_s": 1, "tpot_slo_s": 1}), cfg) == 0.0
    assert scale_down_delay(Deployment(policy="concurrency"), cfg) == 5.0
    assert scale_down_delay(dataclasses.replace(dep, params={**dep.params, "scale_down_delay_s": 2.0}), cfg) == 2.0
    state, out = AutoscaleState(cfg), []
    # 3 instances at 150 tok/s (over the upper bound for 1), then 40 tok/s (under the lower bound
    # per instance, with a request in flight): the policy wants 1 once 0.5 s of calm has passed.
    for i in range(30):
        t = i * 0.1
        load = 150.0 if t < 1.0 else 40.0
        state, decisions = step(state, obs(t, 1, 3, dep, load_tps=load), t)
        out += [(round(t, 1), d) for d in decisions]
    assert [(t, d.desired, d.direction) for t, d in out] == [(1.5, 1, "down")]
    assert out[0][1].reason == "load 40.0 tokens/s, 1 queued or in flight"


def test_every_policy_accepts_a_scale_down_delay() -> None:
    required = {"threshold": {"capacity_tps": 100.0}, "slo": {"ttft_slo_s": 1.0, "tpot_slo_s": 0.1}}
    for name in POLICIES:
        params = {**required.get(name, {}), "scale_down_delay_s": 0.2}
        check_policy(name, params)
        assert "scale_down_delay_s" in POLICIES[name].params
        with pytest.raises(ValueError, match="scale_down_delay_s"):
            check_policy(name, {**params, "scale_down_delay_s": -1.0})


def test_window_is_trimmed_and_models_come_and_go() -> None:
    state = AutoscaleState(AutoscaleConfig(window_s=1.0, max_samples=5))
    for i in range(20):
        state, _ = step(state, obs(i * 0.1, 0, 0), i * 0.1)
    assert [round(s.t, 1) for s in state.models["m"].samples] == [1.5, 1.6, 1.7, 1.8, 1.9]
    state = AutoscaleState(AutoscaleConfig(window_s=1.0))
    for i in range(20):
        state, _ = step(state, obs(i * 0.1, 0, 0), i * 0.1)
    now = 19 * 0.1
    assert state.models["m"].samples == tuple(MetricsSample(t=i * 0.1, ready=0) for i in range(20)
                                              if i * 0.1 >= now - 1.0)
    # A model no longer observed is forgotten; `without` forgets on request (a redeploy).
    state, _ = step(state, obs(2.0, 0, 0, name="other"), 2.0)
    assert set(state.models) == {"other"}
    assert state.without("other").models == {}


def test_empty_state_and_observation() -> None:
    state, decisions = step(AutoscaleState(), Observation({}), 0.0)
    assert state == AutoscaleState() and decisions == []
    assert ModelScaleState().demand == 0


# ---------------------------------------------------------------------------
# the policies registry
# ---------------------------------------------------------------------------


def test_protocol_literal_names_exactly_the_registered_policies() -> None:
    assert set(get_args(m.ScalingPolicy)) == set(POLICIES)
    assert m.DeployModel.model_fields["policy"].default == "concurrency"


def test_concurrency_policy_takes_the_cluster_default_unless_the_deployment_sets_one() -> None:
    dep = Deployment(1, 5, keep_alive_s=30.0)
    cfg = policy_config(dep, {"target": 8})
    assert cfg == ConcurrencyPolicy(target=8, keep_alive_s=30.0, min_instances=1, max_instances=5)
    own = Deployment(1, 5, keep_alive_s=30.0, params={"target": 2, "panic_s": 0.5})
    assert policy_config(own, {"target": 8}) == ConcurrencyPolicy(target=2, panic_s=0.5, keep_alive_s=30.0,
                                                                  min_instances=1, max_instances=5)
    cluster = AutoscaleState(AutoscaleConfig(defaults={"concurrency": {"target": 8}}))
    _, d = step(cluster, obs(0.0, 16, 0, dep), 0.0)
    _, d_own = step(cluster, obs(0.0, 16, 0, own), 0.0)
    assert (d[0].desired, d_own[0].desired) == (2, 5)  # ⌈16/8⌉; ⌈16/2⌉ capped at 5


def test_threshold_policy_through_the_registry_and_a_step() -> None:
    p = POLICIES["threshold"]
    assert p.config is ThresholdPolicy and p.required == ("capacity_tps",)
    dep = Deployment(0, 8, policy="threshold", params={"capacity_tps": 1000, "average_s": 0.3})
    assert policy_config(dep) == ThresholdPolicy(capacity_tps=1000, average_s=0.3, min_instances=0, max_instances=8)
    window = [MetricsSample(t=i * 0.1, ready=2, load_tps=4000.0) for i in range(5)]
    assert p.decide(window, policy_config(dep), None) == 5
    _, decisions = step(AutoscaleState(), obs(0.0, 0, 2, dep, load_tps=4000.0), 0.0)
    assert [(d.desired, d.direction) for d in decisions] == [(5, "up")]


def test_slo_policy_through_the_registry() -> None:
    p = POLICIES["slo"]
    assert p.config is SloPolicy and set(p.required) == {"ttft_slo_s", "tpot_slo_s"}
    assert "idle_s" not in p.params  # the deployment's keep-alive
    dep = Deployment(0, 10, keep_alive_s=42.0, policy="slo", params={"ttft_slo_s": 1.0, "tpot_slo_s": 0.1})
    cfg = policy_config(dep)
    assert cfg == SloPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1, idle_s=42.0, min_instances=0, max_instances=10)
    hot = [MetricsSample(t=i * 0.1, ready=2, ttft_s=(2.0,), tpot_s=(0.05,)) for i in range(5)]
    assert p.decide(hot, cfg, None) == 5  # 2 × (2.0 / 1.0) / 0.8
    _, decisions = step(AutoscaleState(), obs(0.0, 1, 0, dep), 0.0)  # queued, nothing runs
    assert [(d.desired, d.direction) for d in decisions] == [(1, "up")]


@pytest.mark.parametrize(("policy", "params", "message"), [
    ("concurrency", {"tarjet": 4}, "unknown parameter 'tarjet' for scaling policy 'concurrency' \\(known: target"),
    ("concurrency", {"min_instances": 1}, "unknown parameter 'min_instances'"),
    ("concurrency", {"keep_alive_s": 1}, "unknown parameter 'keep_alive_s'"),
    ("slo", {"ttft_slo_s": 1, "tpot_slo_s": 1, "idle_s": 5}, "unknown parameter 'idle_s'"),
    ("concurrency", {"target": -1}, "parameter 'target' of scaling policy 'concurrency' must be a finite number"),
    ("concurrency", {"target": math.nan}, "must be a finite number"),
    ("concurrency", {"target": math.inf}, "must be a finite number"),
    ("concurrency", {"target": True}, "must be a finite number"),
    ("concurrency", {"target": "4"}, "must be a finite number"),
    ("concurrency", {"target": 0}, "scaling policy 'concurrency': target must be > 0"),
    ("concurrency", {"panic_s": 10}, "panic window must not exceed the stable window"),
    ("threshold", {}, "scaling policy 'threshold' needs parameter\\(s\\) capacity_tps"),
    ("threshold", {"capacity_tps": 10, "lower": 0.9, "upper": 0.5}, "need 0 <= lower < upper"),
    ("slo", {"ttft_slo_s": 1}, "needs parameter\\(s\\) tpot_slo_s"),
    ("slo", {"ttft_slo_s": 1, "tpot_slo_s": 1, "quantile": 101}, "quantile must be in \\[0, 100\\]"),
    ("nope", {}, "unknown scaling policy 'nope' \\(known: threshold, concurrency, slo\\)"),
])
def test_bad_policy_parameters_are_refused(policy: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_policy(policy, params)


def test_good_parameters_of_every_policy_pass() -> None:
    check_policy("concurrency", {})
    check_policy("concurrency", {"target": 2, "stable_s": 6, "panic_s": 0.6, "panic_threshold": 2})
    check_policy("threshold", {"capacity_tps": 1000, "upper": 0.8, "lower": 0.3, "scale_down_timeout_s": 0.5})
    check_policy("slo", {"ttft_slo_s": 1, "tpot_slo_s": 0.1, "quantile": 99, "warming_credit": 1})


def test_cluster_defaults_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="unknown parameter 'targett'"):
        AutoscaleConfig(defaults={"concurrency": {"targett": 8}})
    with pytest.raises(ValueError, match="unknown scaling policy"):
        AutoscaleConfig(defaults={"kpa": {}})


# ---------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------


@st.composite
def scenarios(draw):  # type: ignore[no-untyped-def]
    lo = draw(st.integers(0, 2))
    hi = draw(st.integers(max(lo, 1), 6))
    config = AutoscaleConfig(window_s=draw(st.sampled_from([0.5, 2.0, 10.0])),
                             scale_down_delay_s=draw(st.sampled_from([0.0, 0.3, 1.0, 3.0])),
                             resend_s=draw(st.sampled_from([0.0, 0.5, 2.0])),
                             defaults={"concurrency": {"target": draw(st.integers(1, 8))}})
    params = draw(st.sampled_from([{}, {"stable_s": 1.0, "panic_s": 0.2}, {"target": 2.0},
                                   {"scale_down_delay_s": 0.2}, {"target": 2.0, "scale_down_delay_s": 4.0}]))
    dep = Deployment(lo, hi, keep_alive_s=draw(st.sampled_from([0.0, 0.5, 5.0])), params=params)
    ticks, t = [], draw(st.floats(0, 1000))
    for _ in range(draw(st.integers(1, 60))):
        t += draw(st.sampled_from([0.05, 0.1, 0.25, 1.0]))
        current = draw(st.integers(0, 6))
        warming = draw(st.integers(0, current))
        in_flight = draw(st.sampled_from([0, 0, 0, 1, 3, 8, 40]))  # idle spells too
        ticks.append((t, in_flight, current, warming))
    return config, dep, ticks


def play(config: AutoscaleConfig, dep: Deployment, ticks: list) -> list:  # type: ignore[type-arg]
    state, history = AutoscaleState(config), []
    for t, in_flight, current, warming in ticks:
        sample = MetricsSample(t=t, ready=current - warming, warming=warming, in_flight=in_flight)
        o = Observation({"m": ModelObservation(sample, current, dep, (t,) if in_flight else ())})
        before = repr(state)
        new, decisions = step(state, o, t)
        assert repr(state) == before  # the input state is untouched
        assert step(state, o, t) == (new, decisions)  # same input, same output
        history.append((t, current, new.models["m"].desired, decisions))
        state = new
    return history


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_decisions_are_bounded_consistent_and_only_on_a_mismatch(scenario) -> None:  # type: ignore[no-untyped-def]
    config, dep, ticks = scenario
    for _t, current, desired, decisions in play(config, dep, ticks):
        assert dep.min_instances <= desired <= dep.max_instances
        if desired == current:
            assert decisions == []
        for d in decisions:
            assert (d.model, d.desired, d.current) == ("m", desired, current)
            assert d.direction == ("up" if desired > current else "down")
            assert d.reason.startswith("demand " if d.direction == "up" else "idle for ")


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_scale_in_only_after_the_delay_without_a_break(scenario) -> None:  # type: ignore[no-untyped-def]
    config, dep, ticks = scenario
    history = play(config, dep, ticks)
    for i, (t, current, desired, decisions) in enumerate(history):
        if not decisions or not 0 < desired < current:
            continue
        # Walk back over the unbroken run of "fewer than run": it must reach back the delay.
        j = i
        while j > 0 and history[j - 1][2] < history[j - 1][1]:
            j -= 1
        assert t - history[j][0] >= scale_down_delay(dep, config) - 1e-9


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_the_same_request_is_not_repeated_before_resend_s(scenario) -> None:  # type: ignore[no-untyped-def]
    config, dep, ticks = scenario
    last: tuple[int, float] | None = None
    for t, current, desired, decisions in play(config, dep, ticks):
        if desired == current:
            last = None  # a match ends the mismatch: a new one is asked for at once
        for d in decisions:
            if last is not None and last[0] == d.desired:
                assert t - last[1] >= config.resend_s - 1e-9
            last = (d.desired, t)
