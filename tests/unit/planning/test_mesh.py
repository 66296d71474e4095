"""LLM-Mesh's pure decisions (libs/planning/mesh.py): interpolation, headroom order, the three
shadow-validation cases of Fig. 6, watermarks and the reservation station."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from hypothesis import strategies as st

from libs.planning.mesh import (
    MemOp,
    MemoryState,
    MeshInstance,
    Profile,
    ResizeCost,
    RunningRequest,
    abort,
    can_move,
    candidate_order,
    complete,
    default_ttft_slo,
    eviction_victim,
    issue,
    kv_fit,
    kv_grant,
    kv_require,
    kv_resize,
    most_urgent,
    next_instance,
    plan_preemption,
    preemption_candidates,
    profile_samples,
    refreshed,
    sample_points,
    shadow_validate,
    simulate,
)

ascending = st.lists(st.integers(1, 4096), min_size=1, max_size=8, unique=True).map(sorted)
seconds = st.floats(0, 10, allow_nan=False)


def linear_profile(prefill_per_token=0.001, decode_base=0.02, per_request=0.005, per_len=0.00001) -> Profile:
    """Times linear in every variable, sampled at powers of two (interpolation is then exact)."""
    lengths, batches = sample_points(4096), sample_points(64)
    return Profile(lengths, tuple(prefill_per_token * n for n in lengths), batches, lengths,
                   tuple(tuple(decode_base + per_request * b + per_len * b * n for n in lengths) for b in batches))


# --- interpolation ---------------------------------------------------------------------------------


def test_sample_points_are_powers_of_two_up_to_the_maximum():
    assert sample_points(1) == (1,)
    assert sample_points(64) == (1, 2, 4, 8, 16, 32, 64)
    assert sample_points(100) == (1, 2, 4, 8, 16, 32, 64, 100)


@given(st.data())
def test_prefill_interpolation_goes_through_the_samples_and_stays_between_neighbours(data):
    xs = data.draw(ascending)
    ys = sorted(data.draw(st.lists(seconds, min_size=len(xs), max_size=len(xs))))
    p = Profile(tuple(xs), tuple(ys), (1,), (1,), ((0.0,),))
    for x, y in zip(xs, ys):
        assert p.prefill_time(x) == pytest.approx(y)
    x = data.draw(st.integers(xs[0], xs[-1]))
    i = max(j for j, v in enumerate(xs) if v <= x)
    hi = ys[min(i + 1, len(ys) - 1)]
    assert ys[i] - 1e-9 <= p.prefill_time(x) <= hi + 1e-9
    assert p.prefill_time(0) == ys[0]  # below the samples: the first, never less


def test_prefill_beyond_the_samples_extends_the_last_segment():
    p = Profile((128, 256), (0.1, 0.2), (1,), (1,), ((0.0,),))
    assert p.prefill_time(512) == pytest.approx(0.4)
    assert p.prefill_time(192) == pytest.approx(0.15)


def test_beyond_the_samples_a_falling_last_segment_stops_at_the_last_value():
    # a noisy profile (measured on a busy machine) whose last segment falls: a longer prompt is
    # never faster than the longest measured one, however far the line would fall
    p = Profile((8, 16), (0.0030, 0.0024), (1,), (1,), ((0.0,),))
    assert p.prefill_time(12) == pytest.approx(0.0027)  # inside: interpolated as measured
    assert p.prefill_time(64) == pytest.approx(0.0024) == p.prefill_time(10_000)


@given(st.integers(1, 64), st.floats(1, 4096))
def test_decode_interpolation_is_exact_on_a_bilinear_surface(batch, mean_len):
    p = linear_profile()
    # Each grid cell of a bilinear function is reproduced exactly by bilinear interpolation.
    assert p.decode_time(batch, mean_len) == pytest.approx(0.02 + 0.005 * batch + 0.00001 * batch * mean_len)


# --- live refresh ------------------------------------------------------------------------------------

positive = st.floats(1e-3, 10, allow_nan=False)


@given(st.integers(1, 128), st.floats(1, 8192), positive, st.floats(0.05, 1.0))
def test_a_live_decode_moves_the_prediction_toward_it_and_never_past_it(batch, mean_len, observed, rate):
    before = linear_profile()
    predicted = before.decode_time(batch, mean_len)
    after = refreshed(before, decodes=[(batch, mean_len, observed)], rate=rate).decode_time(batch, mean_len)
    target = min(4 * predicted, max(predicted / 4, observed))  # ratios are clamped
    assert min(predicted, target) - 1e-12 <= after <= max(predicted, target) + 1e-12
    assert abs(after - target) <= abs(predicted - target) + 1e-12
    assert all(t >= 0 for row in refreshed(before, decodes=[(batch, mean_len, observed)]).decode_s for t in row)


@given(st.integers(1, 8192), positive, st.floats(0.05, 1.0))
def test_a_live_prefill_moves_the_prediction_toward_it_and_never_past_it(length, observed, rate):
    before = linear_profile()
    predicted = before.prefill_time(length)
    after = refreshed(before, prefills=[(length, observed)], rate=rate).prefill_time(length)
    target = min(4 * predicted, max(predicted / 4, observed))
    assert min(predicted, target) - 1e-12 <= after <= max(predicted, target) + 1e-12


@given(st.integers(1, 128), st.floats(1, 8192), st.integers(1, 8192))
def test_observations_equal_to_the_predictions_change_nothing(batch, mean_len, length):
    p = linear_profile()
    same = refreshed(p, decodes=[(batch, mean_len, p.decode_time(batch, mean_len))],
                     prefills=[(length, p.prefill_time(length))])
    flat = lambda q: [t for row in q.decode_s for t in row]  # noqa: E731
    assert flat(same) == pytest.approx(flat(p)) and same.prefill_s == pytest.approx(p.prefill_s)


def test_only_pure_decode_steps_and_single_prefills_are_samples():
    steps = [(4, 100.0, 0, 0, 0.05),  # four rows decoding
             (0, 0.0, 256, 1, 0.30),  # one prompt prefilled
             (2, 50.0, 64, 1, 0.20),  # mixed: no single sample point
             (0, 0.0, 512, 2, 0.40),  # two prompts batched: neither length alone
             (0, 0.0, 0, 0, 0.01)]  # nothing computed
    assert profile_samples(steps) == ([(4, 100.0, 0.05)], [(256, 0.30)])


def test_a_node_running_twice_slower_is_learned_at_the_sample_points():
    """The worker became twice as slow (a neighbour's load): repeated observations at sample
    points converge on it, and the points no observation touched stay as they were."""
    p = linear_profile()
    slow = p
    for _ in range(40):
        slow = refreshed(slow, decodes=[(8, 256, 2 * p.decode_time(8, 256))], prefills=[(512, 2 * p.prefill_time(512))])
    assert slow.decode_time(8, 256) == pytest.approx(2 * p.decode_time(8, 256), rel=1e-3)
    assert slow.prefill_time(512) == pytest.approx(2 * p.prefill_time(512), rel=1e-3)
    assert slow.decode_time(1, 1) == p.decode_time(1, 1) and slow.prefill_time(1) == p.prefill_time(1)
    with pytest.raises(ValueError):
        refreshed(p, rate=0)


def test_a_profile_refuses_samples_out_of_order_or_of_the_wrong_shape():
    with pytest.raises(ValueError):
        Profile((2, 1), (0.1, 0.2), (1,), (1,), ((0.0,),))
    with pytest.raises(ValueError):
        Profile((1,), (0.1,), (1, 2), (1,), ((0.0,),))
    with pytest.raises(ValueError):
        Profile((1,), (-1.0,), (1,), (1,), ((0.0,),))


# --- headroom and token-level scheduling ----------------------------------------------------------------


def test_headroom_is_equation_one():
    r = RunningRequest("r", start=10.0, prompt_len=100, generated=4, ttft_slo_s=2.0, tpot_slo_s=0.25)
    assert r.headroom(now=12.5) == pytest.approx(10 + 2 + 0.25 * 4 - 12.5)
    assert default_ttft_slo(100) == 2.0 and default_ttft_slo(2048) == 4.0


@given(st.lists(st.tuples(st.floats(0, 10), st.integers(0, 50)), min_size=1, max_size=12), st.floats(0, 20))
def test_the_next_iteration_goes_to_the_instance_with_the_least_headroom(reqs, now):
    p = linear_profile()
    instances = [MeshInstance(f"i{k % 3}", "m", p, ()) for k in range(3)]
    for k, (start, generated) in enumerate(reqs):
        i = instances[k % 3]
        instances[k % 3] = MeshInstance(i.id, "m", p, (*i.requests, RunningRequest(f"r{k}", start, 10, generated)))
    chosen = next_instance(instances, now)
    least = min(r.headroom(now) for i in instances for r in i.requests)
    assert min(r.headroom(now) for r in next(i for i in instances if i.id == chosen).requests) == least
    assert next_instance([MeshInstance("idle", "m", p)], now) is None
    assert most_urgent({i.id: i.requests for i in instances}, now) == chosen


def test_figure_5_a_served_request_gains_one_tpot_less_the_iteration():
    p = Profile((1,), (0.0,), (1,), (1,), ((0.05 / 1.1,),))  # one decode iteration: 0.05 s with the margin
    r = RunningRequest("r", start=0.0, prompt_len=1, generated=1, ttft_slo_s=1.65, tpot_slo_s=0.25)  # headroom 1.9
    inst = MeshInstance("i2", "m", p, (r,))
    assert r.headroom(0.0) == pytest.approx(1.9)
    assert simulate([inst], 0.0, until_tokens={"r": 2}) == ()
    # After one iteration of 0.05 s it has one more token: 1.9 - 0.05 + 0.25 = 2.1 s.
    assert RunningRequest("r", 0.0, 1, 2, 1.65, 0.25).headroom(0.05) == pytest.approx(2.1)


def test_an_iteration_prefills_the_waiting_prompts_together_within_the_token_budget():
    # As the engine steps: one decode over the decoding rows, one batched prefill of the waiting
    # ones in arrival order while they fit the step's budget (the first whatever its length).
    p = linear_profile(prefill_per_token=0.001, decode_base=0.02, per_request=0.0, per_len=0.0)
    reqs = (RunningRequest("old", 0.0, 10, generated=3), RunningRequest("w1", 1.0, 100),
            RunningRequest("w2", 2.0, 100), RunningRequest("w3", 3.0, 100))
    seconds, served = MeshInstance("i", "m", p, reqs, token_budget=1 + 200).iteration()
    assert served == ("old", "w1", "w2")
    assert seconds == pytest.approx(0.02 + 0.2)
    _, served = MeshInstance("i", "m", p, (RunningRequest("long", 0.0, 4000),), token_budget=64).iteration()
    assert served == ("long",)


# --- shadow validation: the three cases of Fig. 6 ------------------------------------------------------


def node_with(decoding: int, prefill_per_token=0.0001, decode_base=0.01, per_request=0.002,
              tpot=0.25, generated=5) -> tuple[list[MeshInstance], Profile]:
    p = linear_profile(prefill_per_token, decode_base, per_request, 0.0)
    reqs = tuple(RunningRequest(f"old{k}", start=0.0, prompt_len=64, generated=generated, ttft_slo_s=2.0,
                                tpot_slo_s=tpot) for k in range(decoding))
    return [MeshInstance("a", "m1", p, reqs), MeshInstance("b", "m2", p, ())], p


def test_a_request_that_fits_is_admitted():
    node, _ = node_with(4)
    new = RunningRequest("new", start=1.0, prompt_len=128, ttft_slo_s=2.0)
    assert shadow_validate(node, node[1], new, now=1.0) .ok


def test_case_1_the_new_requests_prefill_would_end_too_late():
    node, _ = node_with(1, prefill_per_token=0.01)  # 3000 tokens: 30 s of prefill, TTFT SLO 2 s
    new = RunningRequest("new", start=1.0, prompt_len=3000, ttft_slo_s=2.0)
    v = shadow_validate(node, node[1], new, now=1.0)
    assert (v.ok, v.case) == (False, "new_prefill_late")


def test_a_request_overdue_already_is_refused_only_to_keep_the_others_on_time():
    # It waited past its TTFT SLO at the gateway: no node can make it compliant, so case 1 would
    # only keep it waiting (until it timed out); on an idle node it joins, beside a running
    # request it is still refused, since its 30 s prefill would make that one late (case 2).
    idle, _ = node_with(0, prefill_per_token=0.01)
    running, _ = node_with(1, prefill_per_token=0.01)
    new = RunningRequest("new", start=1.0, prompt_len=3000, ttft_slo_s=2.0)
    assert shadow_validate(idle, idle[1], new, now=1.0).case == "new_prefill_late"
    assert shadow_validate(idle, idle[1], new, now=1.0, overdue=True).ok
    v = shadow_validate(running, running[1], new, now=1.0, overdue=True)
    assert (v.ok, v.case) == (False, "existing_late"), v


def test_case_2_an_existing_request_would_be_pushed_past_its_deadline():
    # The old request's next token is due in 0.45 s; the new one joins its instance with a 1 s
    # prefill, which that instance's next step computes too: the old token comes 1.1 s late.
    node, _ = node_with(1, prefill_per_token=0.001, generated=1)
    node[0] = MeshInstance("a", "m1", node[0].profile,
                           (RunningRequest("old0", start=0.0, prompt_len=64, generated=1, ttft_slo_s=0.2,
                                           tpot_slo_s=0.25),))
    new = RunningRequest("new", start=0.0, prompt_len=1000, ttft_slo_s=3.0)
    v = shadow_validate(node, node[0], new, now=0.0)
    assert (v.ok, v.case) == (False, "existing_late"), v
    assert shadow_validate(node, node[0], RunningRequest("new", 0.0, 10, 0, 3.0), now=0.0).ok  # a short one fits
    assert shadow_validate(node, node[1], new, now=0.0).ok  # on the other instance it waits its turn


def test_case_3_the_nodes_decode_iteration_would_exceed_the_tpot_slo():
    # Every request alone is on time, but one decode round over both instances is 0.11 s + 0.11 s
    # (with the margin) against a TPOT SLO of 0.2 s.
    p = Profile((1, 4096), (0.0, 0.0), (1, 2), (1, 4096), ((0.1, 0.1), (0.1, 0.1)))
    old = RunningRequest("old", start=0.0, prompt_len=8, generated=1, ttft_slo_s=100.0, tpot_slo_s=0.2)
    node = [MeshInstance("a", "m1", p, (old,)), MeshInstance("b", "m2", p, ())]
    new = RunningRequest("new", start=0.0, prompt_len=8, ttft_slo_s=100.0, tpot_slo_s=0.2)
    v = shadow_validate(node, node[1], new, now=0.0)
    assert (v.ok, v.case) == (False, "node_tpot_exceeded"), v
    assert shadow_validate(node, node[0], new, now=0.0).ok  # one batch of two: one 0.11 s iteration


def test_a_kv_growth_that_holds_the_engine_thread_counts_against_the_other_models():
    # The old request (another model) has 0.3 s before its next token, and its iteration takes
    # 0.011 s: a small new request fits, unless joining first stalls the node for 0.5 s (the
    # new instance's KV copied into a bigger pool on the engine thread).
    node, _ = node_with(1, generated=1)
    node[0] = MeshInstance("a", "m1", node[0].profile,
                           (RunningRequest("old0", start=0.0, prompt_len=64, generated=1, ttft_slo_s=0.05,
                                           tpot_slo_s=0.25),))
    new = RunningRequest("new", start=0.0, prompt_len=16, ttft_slo_s=3.0)
    assert shadow_validate(node, node[1], new, now=0.0).ok
    assert shadow_validate(node, node[1], new, now=0.0, stall_s=0.2).ok  # within its headroom
    v = shadow_validate(node, node[1], new, now=0.0, stall_s=0.5)
    assert (v.ok, v.case) == (False, "existing_late"), v
    # a request late even without the new one is not held against the stall either
    assert shadow_validate(node, node[1], new, now=1.0, stall_s=0.5).ok


@given(st.floats(0, 1), st.floats(0, 1e-2), st.integers(0, 64), st.floats(0, 2), st.floats(0.01, 1))
def test_the_resize_cost_moves_toward_what_a_resize_took_and_never_past_it(fixed, per_slot, slots, took, rate):
    cost = ResizeCost(fixed, per_slot)
    before, after = cost.seconds(slots), cost.observed(slots, took, rate).seconds(slots)
    if before > 0:
        assert min(before, took) - 1e-12 <= after <= max(before, took) + 1e-12
        assert abs(after - took) <= abs(before - took) + 1e-12
    assert cost.observed(slots, cost.seconds(slots), rate).seconds(slots) == pytest.approx(before)
    assert cost.observed(slots, math.nan, rate) == cost


def test_a_request_late_anyway_does_not_block_a_new_one():
    node, _ = node_with(1)
    node[0] = MeshInstance("a", "m1", node[0].profile, (RunningRequest("old0", 0.0, 64, 1, 0.1, 0.25),))
    new = RunningRequest("new", start=5.0, prompt_len=16, ttft_slo_s=2.0)
    assert shadow_validate(node, node[1], new, now=5.0).ok


def test_a_new_instance_can_be_validated_before_it_exists():
    node, p = node_with(2)
    fresh = MeshInstance("c", "m3", p, ())
    assert shadow_validate(node, fresh, RunningRequest("new", 0.0, 16), now=0.0).ok


def test_cpu_first_then_the_largest_batch_and_preemption_only_of_smaller_batches():
    p = linear_profile()
    r = [RunningRequest(f"r{k}", 0.0, 8) for k in range(6)]
    gpu = MeshInstance("g", "m", p, tuple(r[:3]), device="cuda")
    cpu_small = MeshInstance("c1", "m", p, tuple(r[3:4]))
    cpu_big = MeshInstance("c2", "m", p, tuple(r[4:6]))
    assert [i.id for i in candidate_order([gpu, cpu_small, cpu_big])] == ["c2", "c1", "g"]
    assert [i.id for i in preemption_candidates([gpu, cpu_small, cpu_big], gpu)] == ["c1", "c2"]
    assert preemption_candidates([gpu, cpu_small, cpu_big], cpu_small) == []


def crowded_node(victim_headroom_s: float = 50.0, movable: bool = True):
    """A (batch 2) and B (batch 1) on one node; one decode round over both is 0.11 s + 0.11 s with
    the margin, over a 0.2 s TPOT SLO: a third request on A fits only once B's request leaves."""
    p = Profile((1, 4096), (0.01, 0.01), (1, 2, 3), (1, 4096), ((0.1, 0.1), (0.1, 0.1), (0.1, 0.1)))

    def req(rid, ttft=100.0):
        return RunningRequest(rid, start=0.0, prompt_len=8, generated=1, ttft_slo_s=ttft, tpot_slo_s=0.2)
    a = MeshInstance("a", "m1", p, (req("a0"), req("a1")))
    b = MeshInstance("b", "m2", p, (replace(req("b0", victim_headroom_s - 0.2), movable=movable),))
    new = RunningRequest("new", start=0.0, prompt_len=8, ttft_slo_s=100.0, tpot_slo_s=0.2)
    return [a, b], new


def test_a_larger_instance_preempts_a_smaller_neighbour_whose_requests_can_move():
    node, new = crowded_node()
    assert not shadow_validate(node, node[0], new, now=0.0).ok
    assert [i.id for i in plan_preemption(node, node[0], new, 0.0, {"m1", "m2"})] == ["b"]
    # Never the other way round: B (batch 1) may not break A (batch 2) up.
    assert plan_preemption(node, node[1], new, 0.0, {"m1", "m2"}) == ()
    # Nor when B's model has no instance elsewhere to go on at.
    assert plan_preemption(node, node[0], new, 0.0, {"m1"}) == ()


def test_no_preemption_of_requests_that_would_miss_their_slo_or_moved_once_already():
    node, new = crowded_node(victim_headroom_s=0.005)  # less than its prefill again (0.011 s)
    assert not can_move(node[1].requests[0], node[1].profile, 0.0)
    assert plan_preemption(node, node[0], new, 0.0, {"m2"}) == ()
    node, new = crowded_node(movable=False)
    assert plan_preemption(node, node[0], new, 0.0, {"m2"}) == ()


instances = st.lists(st.tuples(st.integers(0, 4), st.floats(0.01, 5)), min_size=1, max_size=5)


@settings(max_examples=100, deadline=None)
@given(instances, st.integers(1, 5), st.floats(0.15, 0.4))  # TPOT SLOs where preemption often helps
def test_a_preemption_is_the_fewest_smaller_neighbours_and_makes_the_request_fit(shape, target_batch, tpot):
    p = linear_profile(0.001, 0.02, 0.01, 0.0)

    def reqs(prefix, n, ttft):
        return tuple(RunningRequest(f"{prefix}{k}", 0.0, 16, 1 + k, ttft, tpot) for k in range(n))
    node = [MeshInstance("t", "m0", p, reqs("t", target_batch, 5.0))]
    node += [MeshInstance(f"n{j}", f"m{j + 1}", p, reqs(f"n{j}.", b, ttft)) for j, (b, ttft) in enumerate(shape)]
    new = RunningRequest("new", 0.0, 16, 0, 5.0, tpot)
    victims = plan_preemption(node, node[0], new, 0.0, {i.model for i in node})
    if not victims or shadow_validate(node, node[0], new, 0.0).ok:
        return  # (asked only once validation failed)
    assert all(v.batch < node[0].batch and all(can_move(r, v.profile, 0.0) for r in v.requests) for v in victims)
    emptied = lambda gone: [replace(i, requests=()) if i.id in gone else i for i in node]  # noqa: E731
    assert shadow_validate(emptied({v.id for v in victims}), node[0], new, 0.0).ok
    assert not shadow_validate(emptied({v.id for v in victims[:-1]}), node[0], new, 0.0).ok


def test_the_eviction_victim_has_the_longest_headroom():
    reqs = [RunningRequest("a", 0.0, 8, 10), RunningRequest("b", 0.0, 8, 2), RunningRequest("c", 1.0, 8, 10)]
    assert eviction_victim(reqs, 3.0).id == "c"
    assert eviction_victim([], 0.0) is None


# --- elastic KV ------------------------------------------------------------------------------------------


def test_kv_require_is_equation_two():
    # 2 requests: (100 in, 3 out) and (50 in, 80 out), mean output 20: 100+20 + 50+80 = 250 tokens.
    assert kv_require(1000, [(100, 3), (50, 80)], mean_output=20, min_tokens=200) == 250_000
    assert kv_require(1000, [(10, 0)], mean_output=20, min_tokens=200) == 200_000  # L_min floor


@given(st.integers(0, 10**9), st.integers(1, 10**9), st.floats(0, 1))
def test_watermarks_scale_up_early_and_down_lazily(current, require, w):
    new = kv_resize(current, require, w)
    recommend = math.ceil(require * (1 + w))
    assert new >= require  # never below what the live requests need
    if current < require:
        assert new == recommend  # up at once, with room for more
    elif current <= recommend * (1 + w):
        assert new == current  # inside the band: no ping-pong
    else:
        assert new == recommend < current
    assert kv_resize(new, require, w) == new  # a resize is stable


def test_the_grant_compromises_to_the_requirement_then_refuses():
    assert kv_grant(100, 150, 200, available=100) == 200
    assert kv_grant(100, 150, 200, available=60) == 150
    assert kv_grant(100, 150, 200, available=40) is None
    assert kv_grant(300, 150, 200, available=0) == 300  # no growth needed


def test_kv_fit_counts_slots_and_follows_the_watermarks():
    fit = dict(slot_bytes=100, watermark=0.5, min_slots=1, max_slots=8)
    assert kv_fit(1, 0, available=0, **fit) == 1  # L_min: one slot even idle
    assert kv_fit(1, 2, available=10_000, **fit) == 3  # short: up at once to 2 * 1.5 slots
    assert kv_fit(3, 2, available=0, **fit) == 3  # enough: unchanged, nothing asked of the budget
    assert kv_fit(2, 1, available=0, **fit) == 2  # 1 * 1.5 * 1.5 = 2.25 slots is not below 2: lazy
    assert kv_fit(3, 1, available=0, **fit) == 2  # it is below 3: down to the recommendation (1.5 -> 2)
    assert kv_fit(4, 7, available=10_000, **fit) == 8  # never past the ceiling
    # A copying resize holds old and new at once: 3 -> 2*1.5 needs 300 free, the compromise 200.
    assert kv_fit(1, 2, available=300, **fit) == 3
    assert kv_fit(1, 2, available=250, **fit) == 2
    assert kv_fit(1, 2, available=150, **fit) is None
    assert kv_fit(1, 2, available=150, copies=False, **fit) == 2  # in place, the difference is enough


@given(st.integers(1, 16), st.integers(0, 40), st.floats(0, 1), st.integers(1, 4), st.integers(0, 4000))
def test_kv_fit_holds_the_rows_it_can_and_stays_inside_the_budget(current, rows, w, min_slots, available):
    max_slots = 16
    slots = kv_fit(current, rows, slot_bytes=100, watermark=w, min_slots=min_slots, max_slots=max_slots,
                   available=available)
    need = min(max(rows, min_slots), max_slots)
    if slots is None:
        assert current < need and need * 100 > available  # refused only when even the compromise does not fit
    else:
        assert need <= slots <= max_slots
        if slots > current:
            assert slots * 100 <= available  # old + new (the copy) fit in what the budget has free


# --- the reservation station --------------------------------------------------------------------------


def test_a_scale_up_after_a_scale_down_waits_for_it():
    s = MemoryState(capacity=100, budget=100, tracked=100)
    s, ok, started = issue(s, MemOp("down", old=60, new=20))
    assert ok and [o.id for o in started] == ["down"]
    s, ok, started = issue(s, MemOp("up", old=0, new=30))
    assert ok and started == () and [o.id for o in s.waiting] == ["up"]  # 100 + 30 would overrun
    s, ok, _ = issue(s, MemOp("too-big", old=0, new=20))
    assert not ok  # the budget (100 - 40 + 30 = 90) cannot take 20 more
    s, started = complete(s, "down")
    assert [o.id for o in started] == ["up"] and s.tracked == 90 and s.waiting == ()


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(["issue", "complete"]), st.integers(0, 5), st.integers(0, 60)),
                max_size=60), st.integers(60, 200))
def test_no_interleaving_of_issued_operations_exceeds_the_memory_cap(actions, capacity):
    sizes = {k: 0 for k in range(6)}  # what each allocation really holds
    busy: dict[int, MemOp] = {}
    state, n = MemoryState(capacity=capacity), 0

    def start(ops):
        for op in ops:
            if op.delta > 0:
                sizes[int(op.id.split(":")[0])] += op.delta  # a growth allocates as it starts

    started_ids: set[str] = set()
    for kind, k, size in actions:
        if kind == "issue" and k not in busy:
            n += 1
            op = MemOp(f"{k}:{n}", old=sizes[k], new=size)
            state, ok, started = issue(state, op)
            if ok:
                busy[k] = op
                start(started)
                started_ids |= {o.id for o in started}
        elif kind == "complete":
            running = [o for o in state.running if o.id in started_ids]
            if running:
                op = running[k % len(running)]
                if op.delta < 0:
                    sizes[int(op.id.split(":")[0])] += op.delta  # a shrink frees only once done
                state, started = complete(state, op.id)
                del busy[int(op.id.split(":")[0])]
                start(started)
                started_ids |= {o.id for o in started}
        assert sum(sizes.values()) <= capacity  # never an out-of-memory
        assert state.tracked <= capacity and state.budget <= capacity
    while state.running:  # everything issued runs eventually
        op = state.running[0]
        if op.delta < 0:
            sizes[int(op.id.split(":")[0])] += op.delta
        state, started = complete(state, op.id)
        start(started)
        assert sum(sizes.values()) <= capacity
    assert state.waiting == () and sum(sizes.values()) == state.budget == state.tracked


def test_a_failed_shrink_refuses_the_growth_waiting_for_it():
    s = MemoryState(capacity=100, budget=100, tracked=100)
    s, _, _ = issue(s, MemOp("down", old=60, new=20))
    s, ok, started = issue(s, MemOp("up", old=0, new=30))
    assert ok and started == ()
    s, started, refused = abort(s, "down")  # the 40 bytes never came free
    assert started == () and [o.id for o in refused] == ["up"]
    assert s.running == s.waiting == () and s.budget == s.tracked == 100


def test_an_aborted_growth_gives_its_memory_back_and_starts_what_waited():
    s = MemoryState(capacity=100, budget=60, tracked=60)
    s, _, started = issue(s, MemOp("grow", old=0, new=30))  # 90: runs
    s, _, _ = issue(s, MemOp("down", old=40, new=10))  # budget 60, tracking still 90
    s, ok, started = issue(s, MemOp("up", old=0, new=25))  # budget 85; 90 + 25 would overrun: waits
    assert ok and started == ()
    s, started, refused = abort(s, "grow")  # its 30 bytes were never kept
    assert [o.id for o in started] == ["up"] and refused == () and s.tracked == 85 and s.budget == 55
    s, _, _ = abort(s, "up")  # a running growth taken back
    s, started = complete(s, "down")
    assert s.tracked == s.budget == 30 and s.running == s.waiting == ()
    with pytest.raises(KeyError):
        abort(s, "down")


class MemoryOperations(RuleBasedStateMachine):
    """Issue, complete and abort in any order: the memory really held stays within capacity; a
    growth waits only while a shrink runs (the one that can make room), so nothing waits forever."""

    def __init__(self):
        super().__init__()
        self.sizes = {k: 0 for k in range(4)}  # what each allocation really holds
        self.busy: dict[int, MemOp] = {}
        self.n = 0
        self.state = MemoryState(capacity=100)
        self.seen = set()

    def _start(self, ops):
        for op in ops:
            if op.delta > 0:
                self.sizes[int(op.id.split(":")[0])] += op.delta  # a growth allocates as it starts

    @rule(k=st.integers(0, 3), size=st.sampled_from([0, 10, 25, 40, 60]))
    def issue(self, k, size):
        if k in self.busy:
            return
        self.n += 1
        self.state, ok, started = issue(self.state, MemOp(f"{k}:{self.n}", old=self.sizes[k], new=size))
        if ok:
            self.busy[k] = MemOp(f"{k}:{self.n}", old=self.sizes[k], new=size)
            self._start(started)

    @rule(i=st.integers(0, 3))
    def complete(self, i):
        if not self.state.running:
            return
        op = self.state.running[i % len(self.state.running)]
        if op.delta < 0:
            self.sizes[int(op.id.split(":")[0])] += op.delta  # a shrink frees only once done
        self.state, started = complete(self.state, op.id)
        del self.busy[int(op.id.split(":")[0])]
        self._start(started)

    @rule(i=st.integers(0, 3))
    def abort(self, i):
        if not self.busy:
            return
        op = list(self.busy.values())[i % len(self.busy)]
        was_running = op in self.state.running
        waiting = set(self.state.waiting)
        self.state, started, refused = abort(self.state, op.id)
        assert set(refused) <= waiting - {op}
        if was_running and op.delta > 0:
            self.sizes[int(op.id.split(":")[0])] -= op.delta  # a failed growth holds nothing
        for o in (op, *refused):
            del self.busy[int(o.id.split(":")[0])]
        self._start(started)
        self.seen |= {"refused"} if refused else set()

    @invariant()
    def within_capacity_and_nothing_waits_in_vain(self):
        s = self.state
        assert sum(self.sizes.values()) <= s.capacity  # never an out-of-memory
        assert s.tracked <= s.capacity and s.budget <= s.capacity
        assert set(self.busy.values()) == set(s.running) | set(s.waiting)
        if not any(o.delta < 0 for o in s.running):
            assert s.waiting == ()  # nothing can make room any more: nothing waits
        if s.waiting:
            self.seen.add("waits")

    def teardown(self):
        while self.state.running:  # everything issued runs eventually
            self.complete(0)
            self.within_capacity_and_nothing_waits_in_vain()
        assert sum(self.sizes.values()) == self.state.budget == self.state.tracked


MemoryOperations.TestCase.settings = settings(max_examples=500, stateful_step_count=60, deadline=None)
test_no_interleaving_with_aborts_overruns_memory_or_waits_forever = MemoryOperations.TestCase
