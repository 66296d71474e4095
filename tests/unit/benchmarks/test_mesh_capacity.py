"""`bench mesh`'s capacity (benchmarks/bench_mesh.py): the rate the offered load is a multiple of."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_mesh import capacity_rps, worker_rate

times = st.dictionaries(st.sampled_from(["m0", "m1", "m2", "m3"]), st.floats(0.001, 10.0), min_size=1)


@given(times, st.data())
def test_a_workers_rate_is_the_inverse_of_the_request_weighted_mean_time(per_request, data):
    shares = {name: data.draw(st.integers(1, 50)) for name in per_request}
    rate = worker_rate(per_request, shares)
    # between the slowest model's rate and the fastest's, and exactly one model's when alone
    assert 1 / max(per_request.values()) * (1 - 1e-9) <= rate <= 1 / min(per_request.values()) * (1 + 1e-9)
    name = next(iter(per_request))
    assert worker_rate(per_request, {name: 3}) == pytest.approx(1 / per_request[name])


def test_two_models_one_twice_as_slow_half_the_requests_each():
    # 1 s and 2 s per request, equal shares: 1.5 s on average, 2/3 req/s a worker
    assert worker_rate({"a": 1.0, "b": 2.0}, {"a": 5, "b": 5}) == pytest.approx(2 / 3)


def test_capacity_scales_with_workers_and_a_cpu_quota_below_one_cpu():
    one = capacity_rps({"a": 0.5}, {"a": 1}, workers=1, cpu_per_worker=None)
    assert one == pytest.approx(2.0)
    assert capacity_rps({"a": 0.5}, {"a": 1}, workers=4, cpu_per_worker=None) == pytest.approx(8.0)
    assert capacity_rps({"a": 0.5}, {"a": 1}, workers=4, cpu_per_worker=0.5) == pytest.approx(4.0)
    assert capacity_rps({"a": 0.5}, {"a": 1}, workers=4, cpu_per_worker=2.0) == pytest.approx(8.0)  # one thread
