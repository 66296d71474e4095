"""libs.checkpoint.pacing: the emulated host -> device link (real time, small sizes)."""

import threading
import time

import pytest

from libs.checkpoint.pacing import HostToDevicePacer, make_pacer

MBIT = 80  # 10 MB/s: 100 KB take 10 ms
SLACK_S = 0.05  # sleep overshoot on a busy CI machine


def _expected_s(nbytes: int) -> float:
    return nbytes * 8 / (MBIT * 1e6)


def test_sequential_copies_take_bytes_over_rate():
    pacer = HostToDevicePacer(MBIT)
    sizes = [100_000, 250_000, 50_000, 400_000, 200_000]
    t0 = time.monotonic()
    waits = [pacer.pace(n) for n in sizes]
    elapsed = time.monotonic() - t0
    expected = _expected_s(sum(sizes))
    assert expected * 0.99 <= elapsed <= expected + SLACK_S
    for n, w in zip(sizes, waits):
        assert w == pytest.approx(_expected_s(n), abs=0.01)


def test_concurrent_callers_serialize_on_one_link():
    pacer = HostToDevicePacer(MBIT)
    n, per_copy = 4, 250_000
    waits: list[float] = []
    barrier = threading.Barrier(n)

    def copy() -> None:
        barrier.wait()
        waits.append(pacer.pace(per_copy))

    threads = [threading.Thread(target=copy) for _ in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    expected = _expected_s(n * per_copy)
    assert expected * 0.99 <= elapsed <= expected + SLACK_S
    # Each caller queued behind the ones before it: 1, 2, 3, 4 copy times.
    for k, w in enumerate(sorted(waits), 1):
        assert w == pytest.approx(k * _expected_s(per_copy), abs=0.015)


def test_an_idle_link_banks_no_credit():
    pacer = HostToDevicePacer(MBIT)
    pacer.pace(10_000)
    time.sleep(0.05)
    assert pacer.pace(200_000) == pytest.approx(_expected_s(200_000), abs=0.01)


def test_off_outside_emulation():
    assert make_pacer(0) is None
    assert make_pacer(-1) is None
    pacer = make_pacer(500)
    assert isinstance(pacer, HostToDevicePacer) and pacer.rate_mbit == 500
    with pytest.raises(ValueError):
        HostToDevicePacer(0)
