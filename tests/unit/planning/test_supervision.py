"""The supervisor's restart backoff (libs/planning/supervision.py): property tests over random crash histories."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.planning.supervision import RestartBackoff, restart_delay

policies = st.builds(lambda initial, extra, factor, stable: RestartBackoff(initial, initial + extra, factor, stable),
                     st.floats(0, 5), st.floats(0, 60), st.floats(1, 4), st.floats(0, 120))
runs = st.lists(st.floats(0, 200), min_size=1, max_size=30)


def delays(policy: RestartBackoff, run_times: list[float]) -> list[float]:
    out, previous = [], None
    for run in run_times:
        previous = restart_delay(run, previous, policy)
        out.append(previous)
    return out


@given(policies, runs)
def test_every_delay_lies_between_the_initial_and_the_cap(policy, run_times):
    assert all(policy.initial_s <= d <= policy.max_s for d in delays(policy, run_times))


@given(policies, runs)
def test_crashes_in_a_row_never_wait_less_and_a_stable_run_starts_over(policy, run_times):
    ds = delays(policy, run_times)
    for i in range(1, len(ds)):
        if run_times[i] >= policy.stable_s:
            assert ds[i] == policy.initial_s
        else:
            assert ds[i] >= ds[i - 1]
            assert ds[i] == min(policy.max_s, max(policy.initial_s, ds[i - 1] * policy.factor))


@given(policies)
def test_a_crash_loop_reaches_the_cap_and_stays_there(policy):
    ds = delays(policy, [0.0] * 200)
    if policy.factor >= 1.5 and policy.initial_s >= 0.01 and policy.stable_s > 0:
        assert ds[-1] == ds[-2] == policy.max_s


def test_the_first_restart_waits_the_initial_delay():
    assert restart_delay(0.0, None) == RestartBackoff().initial_s


@pytest.mark.parametrize("bad", [dict(initial_s=2, max_s=1), dict(initial_s=-1), dict(factor=0.5),
                                 dict(stable_s=-1)])
def test_a_bad_policy_is_refused(bad):
    with pytest.raises(ValueError):
        RestartBackoff(**bad)
