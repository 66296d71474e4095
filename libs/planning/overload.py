"""Pure measures for `bench scale --overload-rps`: latency percentiles of the requests sent during
the scale-out window, and when throughput first rose after the first block arrived."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def window_latencies(requests: list[tuple[float, float | None, float | None]], t_start: float,
                     t_end: float) -> dict:
    """p50/p90 and the worst (max) of send -> first token and send -> last token over the
    requests sent in [t_start, t_end] (each request: sent, first token, last token; None: it
    got no token)."""
    inside = [(s, f, last) for s, f, last in requests if t_start <= s <= t_end]
    done = [(s, f, last) for s, f, last in inside if f is not None and last is not None]
    first = [f - s for s, f, _ in done]
    whole = [last - s for s, _, last in done]
    return {"requests": len(inside), "without_token": len(inside) - len(done),
            "first_token_p50_s": percentile(first, 0.5), "first_token_p90_s": percentile(first, 0.9),
            "last_token_p50_s": percentile(whole, 0.5), "last_token_p90_s": percentile(whole, 0.9),
            "first_token_max_s": max(first, default=None), "last_token_max_s": max(whole, default=None)}


def first_rise_s(timeline: list[float], step_s: float, after_s: float, baseline: float,
                 margin: float) -> float | None:
    """Start (seconds from the timeline's origin) of the first bucket that begins at or after
    `after_s` and whose rate exceeds `baseline * (1 + margin)`; None if none does."""
    for i, rate in enumerate(timeline):
        start = i * step_s
        if start + 1e-9 >= after_s and rate > baseline * (1 + margin):
            return start
    return None


def mean_rate(timeline: list[float], step_s: float, from_s: float, to_s: float) -> float | None:
    """Mean of the buckets that begin in [from_s, to_s)."""
    rates = [r for i, r in enumerate(timeline) if from_s - 1e-9 <= i * step_s < to_s - 1e-9]
    return sum(rates) / len(rates) if rates else None
