"""Per-key rate limits (libs/planning/ratelimit.py): property tests over random request streams."""

from hypothesis import given
from hypothesis import strategies as st

from libs.planning.ratelimit import Limits, Window, admit, format_reset, settle

# Times in eighths of a second: exact in binary floating point, so "at now + retry_after"
# is exactly the instant the decision names.
gaps = st.integers(min_value=0, max_value=8 * 90).map(lambda g: g / 8)
limits = st.builds(Limits, requests_per_minute=st.none() | st.integers(1, 5),
                   tokens_per_minute=st.none() | st.integers(1, 200))
streams = st.lists(st.tuples(gaps, st.integers(0, 120)), min_size=1, max_size=40)


def replay(lim: Limits, stream: list[tuple[float, int]]):
    """Every decision of a stream of (gap, tokens) requests: [(time, tokens, decision, window before)]."""
    window, now, out = Window(), 0.0, []
    for gap, tokens in stream:
        now += gap
        decision, after = admit(lim, window, now, tokens)
        out.append((now, tokens, decision, window))
        window = after
    return out


@given(limits, streams)
def test_never_more_than_the_limits_within_any_window(lim, stream):
    admitted = [(t, tokens) for t, tokens, d, _ in replay(lim, stream) if d.admitted]
    for start, _ in admitted:  # every window [start, start + 60) that begins at an admission
        inside = [tokens for t, tokens in admitted if start <= t < start + lim.window_s]
        if lim.requests_per_minute is not None:
            assert len(inside) <= lim.requests_per_minute
        if lim.tokens_per_minute is not None:
            assert sum(inside) <= lim.tokens_per_minute


@given(limits, streams)
def test_a_refusal_says_how_long_to_wait_and_that_wait_admits(lim, stream):
    for now, tokens, d, before in replay(lim, stream):
        if d.admitted:
            assert d.retry_after_s == 0 and d.refused_by is None
            continue
        assert d.retry_after_s > 0 and d.refused_by in ("requests", "tokens")
        assert d.too_large == (lim.tokens_per_minute is not None and tokens > lim.tokens_per_minute)
        if d.too_large:
            continue  # no wait admits it
        # The same request at the instant named is admitted; a moment before, it is not.
        assert admit(lim, before, now + d.retry_after_s, tokens)[0].admitted
        assert not admit(lim, before, now + d.retry_after_s - 1 / 8, tokens)[0].admitted


@given(limits, streams)
def test_unlimited_keys_and_within_limit_requests_are_admitted(lim, stream):
    unlimited = Limits()
    for now, tokens, d, before in replay(unlimited, stream):
        assert d.admitted and d.remaining_requests is None and d.remaining_tokens is None
    # After a whole quiet window everything expired: a request within the limits is admitted.
    last = replay(lim, stream)[-1]
    window = admit(lim, last[3], last[0], last[1])[1]
    d, _ = admit(lim, window, last[0] + lim.window_s, 0)
    assert d.admitted


@given(limits, streams)
def test_remaining_counts_what_the_window_holds(lim, stream):
    for _now, _tokens, d, _ in replay(lim, stream):
        if lim.requests_per_minute is not None:
            assert 0 <= d.remaining_requests <= lim.requests_per_minute - d.admitted
        if lim.tokens_per_minute is not None:
            assert 0 <= d.remaining_tokens <= lim.tokens_per_minute
        assert d.reset_requests_s <= lim.window_s


def test_settling_gives_back_the_unused_estimate():
    lim = Limits(tokens_per_minute=100)
    d, w = admit(lim, Window(), 10.0, 90)
    assert d.admitted and d.remaining_tokens == 10
    assert not admit(lim, w, 11.0, 50)[0].admitted
    w = settle(w, 10.0, 90, 30)  # the response used 30 of the 90 asked for
    d, _ = admit(lim, w, 11.0, 50)
    assert d.admitted and d.remaining_tokens == 20
    assert settle(Window(), 10.0, 90, 30) == Window()  # expired meanwhile: nothing to correct


def test_a_request_larger_than_the_token_limit_is_never_admitted():
    d, w = admit(Limits(tokens_per_minute=100), Window(), 0.0, 101)
    assert not d.admitted and d.too_large and d.refused_by == "tokens" and w == Window()


def test_reset_durations_are_written_as_openai_does():
    assert [format_reset(s) for s in (0, 0.0201, 1, 1.5, 59.9994, 60, 360, 61.25)] == [
        "0ms", "21ms", "1s", "1.5s", "1m0s", "1m0s", "6m0s", "1m1.25s"]
