"""A simulated run's figures, per mode, and its plots.

TTFT / TPOT p50 / p90 / p99 (linear interpolation, libs.planning.policies.percentile), SLO
attainment (the share of ALL requests with TTFT <= slo_ttft_s and mean time per output token
<= slo_tpot_s; a lost request misses), instance-seconds (local instances loading, serving or
draining, integrated over the run: one GPU each, so GPU-seconds), the scale-outs' times (from
the load-monitor's decision to the first serving capacity and to the operation's end) and the
requests lost (refused by a full gateway queue, or unfinished at the end).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from libs.planning.policies import percentile
from libs.sim.fleet import RunResult

__all__ = ["instance_seconds", "plot", "summarize"]

QS = (50, 90, 99)


def _pcts(values: Sequence[float], digits: int = 4) -> dict:
    xs = sorted(values)
    return {f"p{q}": (round(percentile(xs, q), digits) if xs else None) for q in QS}


def instance_seconds(series: Sequence[tuple[float, int]], end: float) -> float:
    """The integral of a step function given as (t, level) changes, up to `end`."""
    total = 0.0
    for (t, n), (t2, _) in zip(series, [*series[1:], (end, 0)]):
        total += n * max(0.0, min(t2, end) - min(t, end))
    return total


def summarize(res: RunResult, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    reqs = res.requests
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    tpot = [r.tpot for r in reqs if r.tpot is not None]
    ok = sum(1 for r in reqs if r.done is not None and r.ttft <= slo_ttft_s and (r.tpot or 0.0) <= slo_tpot_s)
    ups = res.scale_ops
    done = [o["done_s"] for o in ups]
    first = [o["first_capacity_s"] for o in ups if o["first_capacity_s"] is not None]
    algorithms: dict[str, int] = {}
    for o in ups:
        algorithms[o["algorithm"]] = algorithms.get(o["algorithm"], 0) + 1
    return {
        "mode": res.mode,
        "requests": len(reqs),
        "ttft_s": _pcts(ttft),
        "tpot_s": _pcts(tpot, 5),
        "slo_attainment": round(ok / len(reqs), 4) if reqs else None,
        "instance_seconds": round(instance_seconds(res.instance_series, res.end), 1),
        "max_instances": max((n for _, n in res.instance_series), default=0),
        "scale_outs": len(ups),
        "scale_out_s": {"mean": round(statistics.fmean(done), 4) if done else None, **_pcts(done)},
        "first_capacity_s": {"mean": round(statistics.fmean(first), 4) if first else None, **_pcts(first)},
        "scale_out_algorithms": algorithms,
        "requests_lost": sum(1 for r in reqs if r.lost),
        "lost_why": sorted({r.lost for r in reqs if r.lost}),
        "events": res.events,
        "notes": res.notes,
    }


def plot(results: Sequence[RunResult], path: str, title: str, slo_ttft_s: float) -> str | None:
    """Instances over time and the TTFT CDF per mode, into `path` (a PNG); None (with the reason
    printed by the caller) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_n, ax_cdf) = plt.subplots(2, 1, figsize=(10, 8))
    for res in results:
        xs, ys = [], []
        for t, n in res.instance_series:
            if xs:
                xs.append(t)
                ys.append(ys[-1])
            xs.append(t)
            ys.append(n)
        ax_n.plot(xs, ys, label=res.mode, linewidth=1)
        ttft = sorted(r.ttft for r in res.requests if r.ttft is not None)
        if ttft:
            ax_cdf.plot(ttft, [(i + 1) / len(res.requests) for i in range(len(ttft))], label=res.mode)
    ax_n.set_xlabel("simulated time (s)")
    ax_n.set_ylabel("instances (loading, serving, draining)")
    ax_n.legend()
    ax_cdf.axvline(slo_ttft_s, color="grey", linestyle="--", label=f"SLO {slo_ttft_s:g} s")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("share of all requests")
    ax_cdf.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
