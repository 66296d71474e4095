"""The worker's memory of attempts cancelled before their generate came (the gateway stopped
waiting for the answer and sent the request elsewhere)."""

from hypothesis import given
from hypothesis import strategies as st

from services.worker.service import CancelledAttempts


def test_a_cancelled_attempt_is_refused_once_and_other_attempts_are_not():
    cancelled = CancelledAttempts(ttl_s=60)
    cancelled.add("r1", 3, now=0.0)
    assert not cancelled.take("r1", 4) and not cancelled.take("r2", 3)
    assert cancelled.take("r1", 3)
    assert not cancelled.take("r1", 3)  # an attempt comes once


@given(st.lists(st.floats(0, 1000, allow_nan=False), min_size=1, max_size=40))
def test_only_attempts_younger_than_the_ttl_are_kept(gaps):
    cancelled, now, added = CancelledAttempts(ttl_s=100), 0.0, []
    for k, gap in enumerate(gaps):
        now += gap
        cancelled.add("r", k, now)
        added.append(now)
    # Forgotten as new ones come (no timer): after an add, exactly those within the TTL are kept.
    kept = [k for k, at in enumerate(added) if at + 100 > now]
    assert len(cancelled) == len(kept)
    assert all(cancelled.take("r", k) for k in kept)
