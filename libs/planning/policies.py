"""Scaling policies: a window of metrics samples → desired instance count.

Each policy is a pure function of the samples (oldest first) and its config;
time-based rules (scale-down timeouts, keep-alive) are evaluated against the
timestamps inside the window, so the load-monitor needs no hidden state
beyond the window it already keeps.  "Instances" counts ready instances
plus those still warming up (loading, or serving through pipelines / live
pairs), because those are already paid for.

* :func:`threshold_policy` — BlitzScale §5.3: scale up as soon as the average
  load exceeds an upper bound, with enough instances for the demand; scale
  down only after the load stayed under a lower bound for a (sub-second)
  timeout.
* :func:`concurrency_policy` — Knative's KPA as used by ServerlessLLM-style
  platforms: instances = ⌈in-flight requests / target concurrency⌉ over a
  stable window, a short panic window that can only scale up, and keep-alive
  before scaling to zero.
* :func:`slo_policy` — layercast's SLO saturation: how far the TTFT/TPOT
  percentiles are over their SLOs, with credit for warming instances so one
  burst is not answered twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "MetricsSample",
    "ThresholdPolicy",
    "ConcurrencyPolicy",
    "SloPolicy",
    "threshold_policy",
    "concurrency_policy",
    "slo_policy",
    "percentile",
]


@dataclass(frozen=True)
class MetricsSample:
    """One monitoring interval of one model (timestamps in seconds)."""

    t: float
    ready: int  # instances holding the whole model and serving
    warming: int = 0  # instances being loaded (pipelines / live pairs / plain load)
    load_tps: float = 0.0  # demand in tokens/s: arrivals plus queued work to drain
    in_flight: int = 0  # requests queued or running
    ttft_s: tuple[float, ...] = field(default=())  # TTFT observations in the interval
    tpot_s: tuple[float, ...] = field(default=())  # time-per-output-token observations


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _clamp(n: int, lo: int, hi: int | None) -> int:
    n = max(lo, n)
    return n if hi is None else min(hi, n)


def _current(window: Sequence[MetricsSample]) -> int:
    last = window[-1]
    return last.ready + last.warming


def _since(window: Sequence[MetricsSample], seconds: float) -> list[MetricsSample]:
    # Closed interval [now - seconds, now]: used where *every* sample of a
    # period must agree (timeouts), so the boundary sample counts.
    start = window[-1].t - seconds
    return [s for s in window if s.t >= start - 1e-12]


def _last(window: Sequence[MetricsSample], seconds: float) -> list[MetricsSample]:
    # Half-open (now - seconds, now]: averaging windows, as Knative's; never empty. The window is
    # in time order: scan back from its end (a tick reads a few samples of a long window).
    start = window[-1].t - seconds + 1e-12
    i = len(window)
    while i > 0 and window[i - 1].t > start:
        i -= 1
    return list(window[i:]) or [window[-1]]


def _covers(window: Sequence[MetricsSample], seconds: float) -> bool:
    # The window reaches back at least `seconds` (otherwise a timeout cannot
    # have elapsed yet, e.g. right after start-up).
    return window[-1].t - window[0].t >= seconds - 1e-12


# ---------------------------------------------------------------------------
# Threshold (BlitzScale §5.3)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ThresholdPolicy:
    capacity_tps: float  # profiled tokens/s one instance sustains (offline, §5.3)
    upper: float = 0.8  # scale up when load per instance > upper·capacity
    lower: float = 0.3  # scale down when load per instance < lower·capacity …
    scale_down_timeout_s: float = 0.5  # … for this long (BlitzScale: sub-second)
    average_s: float = 1.0  # averaging window for the scale-up decision
    min_instances: int = 0
    max_instances: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_tps <= 0:
            raise ValueError("capacity_tps must be > 0")
        if not 0 <= self.lower < self.upper:
            raise ValueError("need 0 <= lower < upper")


def threshold_policy(window: Sequence[MetricsSample], cfg: ThresholdPolicy) -> int:
    """BlitzScale §5.3: upper bound → scale up now, lower bound + timeout → down.

    Up: when the average load over ``average_s`` exceeds upper·capacity per
    instance, allocate enough instances to bring it back under the upper
    bound.  Down: only if every sample of the last ``scale_down_timeout_s``
    was under lower·capacity per instance; shrink to what the peak of that
    period needs at the upper bound (so the next decision does not bounce
    straight back up).  Zero load over the timeout goes to ``min_instances``.

    Requests need an instance: with none, any load or any request queued
    asks for one at once (scale from zero on the first request, however
    small its load against the capacity), and while requests are queued
    or running the policy never goes below one.
    """
    if not window:
        return cfg.min_instances
    cur = _current(window)
    busy = 1 if window[-1].in_flight > 0 else 0
    per_upper = cfg.upper * cfg.capacity_tps
    recent = _last(window, cfg.average_s)
    avg = sum(s.load_tps for s in recent) / len(recent)
    need = math.ceil(avg / per_upper - 1e-9) if avg > 0 else 0
    if cur == 0 and (window[-1].load_tps > 0 or busy):
        need = max(need, 1)
    if need > cur:
        return _clamp(need, cfg.min_instances, cfg.max_instances)
    if _covers(window, cfg.scale_down_timeout_s):
        calm = _since(window, cfg.scale_down_timeout_s)
        if all(s.load_tps < cfg.lower * cfg.capacity_tps * max(s.ready + s.warming, 1) for s in calm):
            peak = max(s.load_tps for s in calm)
            target = max(math.ceil(peak / per_upper - 1e-9) if peak > 0 else 0, busy)
            return _clamp(min(cur, target), cfg.min_instances, cfg.max_instances)
    return _clamp(cur, cfg.min_instances, cfg.max_instances)


# ---------------------------------------------------------------------------
# Concurrency target with keep-alive (Knative KPA / ServerlessLLM)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConcurrencyPolicy:
    target: float = 4.0  # requests in flight per instance
    stable_s: float = 6.0  # averaging window for normal decisions
    panic_s: float = 0.6  # short window that reacts to bursts
    panic_threshold: float = 2.0  # panic when short-window demand ≥ this × current capacity
    keep_alive_s: float = 60.0  # idle time before scaling to zero
    min_instances: int = 0
    max_instances: int | None = None

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError("target must be > 0")
        if self.panic_s > self.stable_s:
            raise ValueError("panic window must not exceed the stable window")


def concurrency_policy(
    window: Sequence[MetricsSample], cfg: ConcurrencyPolicy, *, last_request_at: float | None = None
) -> int:
    """⌈average in-flight / target⌉, with Knative's panic mode and keep-alive.

    Stable: average in-flight over ``stable_s``.  Panic: if the average over
    ``panic_s`` needs ≥ panic_threshold × the current instances, follow it
    and never scale down while panicking.  Keep-alive: while any request was
    in flight during the last ``keep_alive_s`` (or the window is shorter than
    that), keep at least one instance — scale-to-zero only after a full
    keep-alive of silence.  A caller whose window is shorter than the
    keep-alive passes ``last_request_at`` (same clock as ``t``) instead.
    """
    if not window:
        return cfg.min_instances
    cur = _current(window)
    stable = _last(window, cfg.stable_s)
    panic = _last(window, cfg.panic_s)
    want_stable = math.ceil(sum(s.in_flight for s in stable) / len(stable) / cfg.target - 1e-9)
    want_panic = math.ceil(sum(s.in_flight for s in panic) / len(panic) / cfg.target - 1e-9)
    if want_panic >= cfg.panic_threshold * max(cur, 1) or (cur == 0 and want_panic > 0):
        want = max(cur, want_panic, want_stable)
    else:
        want = want_stable
    if want == 0:
        if last_request_at is not None:
            idle_long_enough = window[-1].t - last_request_at >= cfg.keep_alive_s and window[-1].in_flight == 0
        else:
            idle_long_enough = _covers(window, cfg.keep_alive_s) and all(
                s.in_flight == 0 for s in _since(window, cfg.keep_alive_s)
            )
        if not idle_long_enough and cur > 0:
            want = 1
    return _clamp(want, cfg.min_instances, cfg.max_instances)


# ---------------------------------------------------------------------------
# SLO saturation
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SloPolicy:
    ttft_slo_s: float
    tpot_slo_s: float
    quantile: float = 90.0  # percentile compared with the SLOs
    target: float = 0.8  # aim for percentile = target × SLO (headroom)
    scale_down_below: float = 0.4  # saturation under this for the timeout → shrink
    scale_down_timeout_s: float = 2.0
    warming_credit: float = 0.5  # a warming instance counts as this much of a ready one
    window_s: float = 2.0  # observations older than this are ignored
    idle_s: float = 60.0  # keep-alive: no traffic this long → min_instances
    min_instances: int = 0
    max_instances: int | None = None

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("SLOs must be > 0")
        if not 0 < self.target <= 1:
            raise ValueError("target must be in (0, 1]")
        if not 0 <= self.warming_credit <= 1:
            raise ValueError("warming_credit must be in [0, 1]")
        if not 0 <= self.quantile <= 100:
            raise ValueError("quantile must be in [0, 100]")


def _saturation(samples: Sequence[MetricsSample], cfg: SloPolicy) -> float | None:
    ttft = [x for s in samples for x in s.ttft_s]
    tpot = [x for s in samples for x in s.tpot_s]
    parts = []
    if ttft:
        parts.append(percentile(ttft, cfg.quantile) / cfg.ttft_slo_s)
    if tpot:
        parts.append(percentile(tpot, cfg.quantile) / cfg.tpot_slo_s)
    return max(parts) if parts else None


def slo_policy(window: Sequence[MetricsSample], cfg: SloPolicy) -> int:
    """Scale by how saturated the SLOs are, crediting warming instances.

    saturation = max(p_q(TTFT)/SLO_ttft, p_q(TPOT)/SLO_tpot) over ``window_s``.
    Latency grows with load per instance, so ready·saturation/target ready
    instances would bring the percentile to target·SLO.  Warming instances
    already count ``warming_credit`` each toward that (they are about to add
    capacity; counting them fully would under-react during long loads,
    ignoring them would double-scale a burst).  Scale-down (only with
    nothing warming): the saturation over ``window_s`` up to each sample of
    the last ``scale_down_timeout_s`` under ``scale_down_below`` → the
    instances that would put it at target (at least one).  Over ``window_s``,
    not per sample: samples are short (a tick) and most hold no observation
    even under steady load.  No requests and no observations for
    ``idle_s`` → ``min_instances`` (keep-alive).  Requests queued with no
    instance at all ask for one.
    """
    if not window:
        return cfg.min_instances
    last = window[-1]
    cur = last.ready + last.warming
    sat = _saturation(_last(window, cfg.window_s), cfg)
    if cur == 0:
        return _clamp(1 if last.in_flight > 0 else 0, cfg.min_instances, cfg.max_instances)
    if sat is None:
        idle = _covers(window, cfg.idle_s) and all(
            s.in_flight == 0 and not s.ttft_s and not s.tpot_s for s in _since(window, cfg.idle_s)
        )
        return _clamp(0 if idle else cur, cfg.min_instances, cfg.max_instances)
    effective = last.ready + cfg.warming_credit * last.warming
    needed = max(last.ready, 1) * sat / cfg.target
    if needed > effective + 1e-9:
        extra = math.ceil(needed - effective - 1e-9)
        return _clamp(cur + extra, cfg.min_instances, cfg.max_instances)
    if last.warming == 0 and _covers(window, cfg.scale_down_timeout_s):
        calm = _since(window, cfg.scale_down_timeout_s)
        sats = [_saturation([x for x in window if s.t - cfg.window_s < x.t <= s.t + 1e-12], cfg) for s in calm]
        if all(x is not None and x < cfg.scale_down_below for x in sats):
            want = max(1, math.ceil(needed - 1e-9))
            return _clamp(min(cur, want), cfg.min_instances, cfg.max_instances)
    return _clamp(cur, cfg.min_instances, cfg.max_instances)
