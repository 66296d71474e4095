"""Trace replay, the pure part of `layercast bench trace`: parse a request trace, transform
it to fit a small cluster, and summarise what a replay measured.

A trace is a CSV with the columns TIMESTAMP, ContextTokens, GeneratedTokens (the Azure LLM
inference traces 2023; TIMESTAMP is a date-time with a fractional second, or plain seconds).
`apply_transform` turns its rows into `ReplayRequest`s (when to send, prompt and output
length); every mode of a benchmark replays the same list. The transformation, in order:

1. window: keep the rows with `start_s <= t - t_first < start_s + duration_s`;
2. tokens: the prompt (output) lengths of the windowed rows are fitted under
   `max_prompt_tokens` (`max_output_tokens`), either by `scale` (multiply every length by
   cap / observed max of the window, rounding, at least 1: keeps the shape of the
   distribution; nothing changes when the observed max is under the cap) or by `clip`
   (min(length, cap): keeps every length under the cap as it is);
3. thinning: row i of the file is kept iff u_i < rate_scale, u_i the i-th draw of
   `random.Random(seed)` over the whole file: deterministic, independent of the window, and
   a smaller rate keeps a subset of what a larger rate keeps;
4. time: send at (t - t_first - start_s) / time_scale seconds after the replay starts.

No I/O except `parse_trace`'s reading of a file; everything is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from libs.planning.policies import percentile
# The trace and its transformation moved to libs.planning.trace (layercast simulate reads traces too);
# re-exported here for the benchmark and its tests.
from libs.planning.trace import (  # noqa: F401
    TOKEN_SCALINGS,
    ReplayRequest,
    TraceRow,
    Transform,
    _timestamp_s,
    apply_transform,
    fit_tokens,
    parse_trace,
    thinning_draws,
)

QUANTILES = (50, 90, 99)
ENDED_STATES = frozenset({"stopped", "failed"})


def transform_summary(rows: Sequence[TraceRow], tf: Transform, requests: Sequence[ReplayRequest]) -> dict:
    """Every transformation parameter and what came out of it (for the JSON report)."""
    end = math.inf if tf.duration_s is None else tf.start_s + tf.duration_s
    window = [r for r in rows if tf.start_s <= r.t_s < end]
    if tf.duration_s is not None:
        replay_s = tf.duration_s / tf.time_scale
    else:
        replay_s = max(0.0, (rows[-1].t_s if rows else 0.0) - tf.start_s) / tf.time_scale
    out = asdict(tf)
    out.update({
        "order": "window (start_s, duration_s) -> tokens (observed max of the window) -> thin (rate_scale, seed) "
                 "-> time (/ time_scale)",
        "token_fitting": {"scale": "length * cap / observed max of the window, rounded, >= 1 (only if max > cap)",
                          "clip": "min(length, cap), >= 1"},
        "trace_rows": len(rows),
        "window_rows": len(window),
        "window_max_prompt_tokens": max((r.prompt_tokens for r in window), default=0),
        "window_max_output_tokens": max((r.output_tokens for r in window), default=0),
        "requests": len(requests),
        "replay_duration_s": round(replay_s, 3),
        "last_send_at_s": round(requests[-1].send_at_s, 3) if requests else 0.0,
        "mean_rate_rps": round(len(requests) / replay_s, 3) if replay_s > 0 else None,
        "prompt_tokens": summarize([r.prompt_tokens for r in requests], digits=1),
        "output_tokens": summarize([r.output_tokens for r in requests], digits=1),
    })
    return out


# --- measurements -----------------------------------------------------------------------------


def percentiles(values: Iterable[float], qs: Sequence[float] = QUANTILES, digits: int | None = 4) -> dict:
    """{"p50": .., "p90": .., "p99": ..} (linear interpolation); None for each when there are no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    out = {}
    for q in qs:
        v = percentile(xs, q) if xs else None
        out[f"p{q:g}"] = round(v, digits) if v is not None and digits is not None else v
    return out


def summarize(values: Sequence[float], digits: int = 4) -> dict:
    return {"min": min(values, default=None), "mean": round(sum(values) / len(values), digits) if values else None,
            "max": max(values, default=None), **percentiles(values, digits=digits)}


def attains_slo(ttft_s: float | None, tbt_s: float | None, slo_ttft_s: float, slo_tbt_s: float) -> bool:
    """A finished request attains the SLO iff TTFT <= slo_ttft and its mean TBT <= slo_tbt (a one-token
    answer has no TBT: only its TTFT counts); a failed request (no TTFT) never does."""
    if ttft_s is None:
        return False
    return ttft_s <= slo_ttft_s and (tbt_s is None or tbt_s <= slo_tbt_s)


def slo_attainment(samples: Sequence[tuple[float | None, float | None]], slo_ttft_s: float,
                   slo_tbt_s: float) -> float | None:
    """Fraction of requests (failed ones included, as misses) that attain the SLO; None for no requests."""
    if not samples:
        return None
    return sum(attains_slo(ttft, tbt, slo_ttft_s, slo_tbt_s) for ttft, tbt in samples) / len(samples)


def instance_intervals(events: Iterable[tuple[str, str, float]], t_start: float,
                       t_end: float) -> dict[str, tuple[float, float]]:
    """Each instance's [start, end) inside [t_start, t_end] from its events (instance_id, state, time):
    it starts at its first event (whatever the state, normally `loading`) and ends at its first
    `stopped` / `failed` event, or at t_end. Instances entirely outside the window are left out."""
    first: dict[str, float] = {}
    ended: dict[str, float] = {}
    for iid, state, t in sorted(events, key=lambda e: e[2]):
        first.setdefault(iid, t)
        if state in ENDED_STATES and iid not in ended:
            ended[iid] = t
    out = {}
    for iid, start in first.items():
        s, e = max(start, t_start), min(ended.get(iid, t_end), t_end)
        if e > s:
            out[iid] = (s, e)
    return out


def instance_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, e - s) for s, e in intervals)


def instance_steps(intervals: Iterable[tuple[float, float]], t_start: float,
                   t_end: float) -> list[tuple[float, int]]:
    """Instances over time as a step series [(t, n), ...]: n instances from t until the next point,
    from (t_start, n) to a closing (t_end, n); intervals are clipped to [t_start, t_end]."""
    deltas: dict[float, int] = {}
    n0 = 0
    for s, e in intervals:
        s, e = max(s, t_start), min(e, t_end)
        if e <= s:
            continue
        if s == t_start:
            n0 += 1
        else:
            deltas[s] = deltas.get(s, 0) + 1
        if e < t_end:
            deltas[e] = deltas.get(e, 0) - 1
    steps = [(t_start, n0)]
    n = n0
    for t in sorted(deltas):
        if deltas[t] == 0:
            continue
        n += deltas[t]
        steps.append((t, n))
    steps.append((t_end, n))
    return steps


def step_integral(steps: Sequence[tuple[float, int]]) -> float:
    """The area under a step series: equals instance_seconds of the intervals it came from."""
    return sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(steps, steps[1:]))


def rate_series(send_times_s: Iterable[float], bin_s: float, duration_s: float) -> list[tuple[float, float]]:
    """Requests per second in bins of bin_s: [(bin start, rate), ...] covering [0, duration_s)."""
    if bin_s <= 0:
        raise ValueError("bin_s must be > 0")
    n_bins = max(1, math.ceil(duration_s / bin_s))
    counts = [0] * n_bins
    for t in send_times_s:
        if 0 <= t:
            counts[min(n_bins - 1, int(t // bin_s))] += 1
    return [(i * bin_s, c / bin_s) for i, c in enumerate(counts)]


def scale_out_times(ops: Iterable[tuple[str, dict, dict]]) -> list[dict]:
    """Each finished scale-up's times from the load-monitor's decision, as `layercast simulate`
    reports them (libs/sim/fleet.py `_closed`): to its first serving capacity (an instance or an
    execution pipeline ready) and to the operation's end. `ops`: (direction, timings, plan) of
    each operation; scale-ins and operations without a decision or an end are left out."""
    out = []
    for direction, timings, plan in ops:
        decided = timings.get("decided") or timings.get("planned")
        if direction != "up" or decided is None or "done" not in timings:
            continue
        ready = [v for k, v in timings.items() if k.startswith(("ready:", "pipeline_ready:"))]
        out.append({"algorithm": plan.get("algorithm", plan.get("kind")),
                    "first_capacity_s": round(min(ready) - decided, 4) if ready else None,
                    "done_s": round(timings["done"] - decided, 4)})
    return out


def scale_out_summary(times: Sequence[dict]) -> dict:
    """Mean and percentiles of the scale-ups' decision -> end times (None without one)."""
    done = [t["done_s"] for t in times]
    return {"n": len(done), "mean": round(sum(done) / len(done), 4) if done else None,
            **percentiles(done)}
