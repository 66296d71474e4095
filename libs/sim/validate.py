"""`layercast simulate --validate`: the simulator against measured `layercast bench trace` runs.

Pure (the CLI runs the benchmark or reads its JSON files). Three steps:

1. :func:`bench_setting` reads the setting out of a `bench trace` JSON: the trace transform
   (rebuilt as :class:`libs.planning.trace.Transform`, so the simulator replays exactly the requests
   the benchmark sent), the number of workers, keep-alive, scale-down delay, target in flight,
   serverlessllm's host keep-alive, the SLO, the emulated profile (link, disk, host->device, CPU
   quota) and the model (preset, blocks). Several files must share it (:func:`same_setting`).
2. :func:`fleet_config` turns it into the simulator's :class:`~libs.sim.fleet.FleetConfig`, and
   :func:`check_profile` says where the profile was measured for another setting.
3. :func:`compare` puts each simulated figure beside the real runs' median and range, with the
   relative error and whether it is within the issue's tolerance (:data:`METRICS`):
   instance-seconds and mean scale-out time within 15 % of the median; TTFT p50 / p99 within
   25 % of the median or inside the range of the real runs, whichever is wider; TPOT (the
   benchmark's TBT: (last token - first) / (tokens - 1), the simulator's definition too) is
   reported without a verdict.

Instance-seconds are counted as the benchmark counts them (:func:`sim_instance_seconds`): from
the replay's start to the later of its end and the last request's end, not through the
keep-alive tail after it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libs.planning.trace import Transform
from libs.sim.fleet import FleetConfig, RunResult
from libs.sim.profile import SimProfile
from libs.sim.report import instance_seconds, summarize

__all__ = ["BURST_METRICS", "METRICS", "BenchSetting", "BurstSetting", "burst_setting", "burst_trials",
           "compare_burst", "simulate_burst", "Metric", "ValidationError", "bench_setting", "check_profile", "compare",
           "fleet_config", "fmt", "measured_row", "same_setting", "sim_figures", "sim_instance_seconds", "table",
           "validate_rows", "verdicts"]


class ValidationError(ValueError):
    """A measured file that cannot be validated against (names what is missing or differs)."""


@dataclass(frozen=True)
class Metric:
    key: str  # the figure's name in a comparison row
    label: str
    tolerance: float | None  # relative, against the real runs' median; None: reported only
    range_ok: bool = False  # inside [min, max] of the real runs also passes


METRICS: tuple[Metric, ...] = (
    Metric("instance_seconds", "instance-s", 0.15),
    Metric("scale_out_s", "scale-out s (mean)", 0.15),
    Metric("ttft_p50", "TTFT p50", 0.25, range_ok=True),
    Metric("ttft_p99", "TTFT p99", 0.25, range_ok=True),
    Metric("tpot_p50", "TPOT p50", None),
    Metric("tpot_p99", "TPOT p99", None),
)


@dataclass(frozen=True)
class BenchSetting:
    trace: str
    transform: Transform
    replay_s: float  # the benchmark's replay window (duration / time scale)
    requests: int
    workers: int
    max_instances: int
    keep_alive_s: float
    scale_down_delay_s: float
    target_concurrency: int
    policy: str
    policy_params: Mapping[str, float]
    serverlessllm_keep_alive_s: float
    slo_ttft_s: float
    slo_tpot_s: float
    emulated: bool
    link_mbit: float | None  # the emulated profile's caps (None: not emulated / not capped)
    disk_mbit: float | None
    h2d_mbit: float | None
    cpu_quota: float | None
    preset: str | None
    blocks: int
    modes: tuple[str, ...] = field(default=())
    prefill_ahead: bool = False  # the workers ran prefills ahead of their loads (recorded since they do)

    def key(self) -> tuple:
        """What two runs must share to be runs of one setting (everything but the modes)."""
        return (self.transform, self.workers, self.max_instances, self.keep_alive_s, self.scale_down_delay_s,
                self.target_concurrency, self.policy, tuple(sorted(self.policy_params.items())),
                self.serverlessllm_keep_alive_s, self.emulated, self.link_mbit, self.disk_mbit, self.h2d_mbit,
                self.cpu_quota, self.preset, self.blocks, self.prefill_ahead)


def _get(data: Mapping, path: str) -> object:
    cur: object = data
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise ValidationError(f"not a `layercast bench trace --json` result: no {path}")
        cur = cur[part]
    return cur


def _cap(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


def bench_setting(data: Mapping) -> BenchSetting:
    """The setting of one `layercast bench trace --json` result (ValidationError if it is not one)."""
    if not isinstance(data, Mapping):
        raise ValidationError("not a `layercast bench trace --json` result: not a JSON object")
    tf_raw = _get(data, "transform")
    try:
        tf = Transform(**{k: tf_raw[k] for k in ("time_scale", "rate_scale", "max_prompt_tokens",
                                                  "max_output_tokens", "prompt_scaling", "output_scaling",
                                                  "start_s", "duration_s", "seed")})
    except KeyError as e:
        raise ValidationError(f"transform.{e.args[0]}: missing") from None
    except (TypeError, ValueError) as e:
        raise ValidationError(f"transform: {e}") from None
    s = _get(data, "settings")
    emu = s.get("emulation_profile") or {} if isinstance(s, Mapping) else {}
    results = _get(data, "results")
    if not isinstance(results, list) or not results:
        raise ValidationError("results: no mode was measured")
    try:
        return BenchSetting(
            trace=str(data.get("trace", "")), transform=tf,
            replay_s=float(tf_raw.get("replay_duration_s") or 0.0), requests=int(tf_raw["requests"]),
            workers=int(s["workers"]), max_instances=int(s.get("max_instances") or s["workers"]),
            keep_alive_s=float(s["keep_alive_s"]), scale_down_delay_s=float(s["scale_down_delay_s"]),
            target_concurrency=int(s["target_concurrency"]), policy=str(s.get("policy") or "concurrency"),
            policy_params=dict(s.get("policy_params") or {}),
            serverlessllm_keep_alive_s=float(s["serverlessllm_keep_alive_s"]),
            slo_ttft_s=float(_get(data, "slo.ttft_s")), slo_tpot_s=float(_get(data, "slo.tbt_s")),
            emulated=bool(s.get("emulated")), link_mbit=_cap(emu.get("link_mbit")),
            disk_mbit=_cap(emu.get("disk_read_mbit")), h2d_mbit=_cap(emu.get("host_to_device_mbit")),
            cpu_quota=_cap(emu.get("cpu_quota")), preset=s.get("model_preset"), blocks=int(s.get("blocks") or 0),
            modes=tuple(str(r["mode"]) for r in results), prefill_ahead=bool(s.get("prefill_ahead", False)))
    except KeyError as e:
        raise ValidationError(f"settings.{e.args[0]}: missing") from None
    except (TypeError, ValueError) as e:
        raise ValidationError(f"settings: {e}") from None


def same_setting(settings: Sequence[BenchSetting]) -> BenchSetting:
    """The one setting of several runs; ValidationError naming the first field that differs."""
    if not settings:
        raise ValidationError("no measured run")
    first = settings[0]
    for i, other in enumerate(settings[1:], start=2):
        if other.key() != first.key():
            names = ("transform", "workers", "max_instances", "keep_alive_s", "scale_down_delay_s",
                     "target_concurrency", "policy", "policy_params", "serverlessllm_keep_alive_s", "emulated",
                     "link_mbit", "disk_mbit", "h2d_mbit", "cpu_quota", "preset", "blocks", "prefill_ahead")
            which = next(n for n, a, b in zip(names, first.key(), other.key()) if a != b)
            raise ValidationError(f"measured run {i} has another {which} than run 1: not runs of one setting")
    return first


def fleet_config(setting: BenchSetting, mode: str, *, tick_s: float = 0.1, seed: int = 0) -> FleetConfig:
    """The simulator's configuration of the benchmark's cluster for one mode."""
    return FleetConfig(
        nodes=setting.workers, mode=mode, max_instances=setting.max_instances, keep_alive_s=setting.keep_alive_s,
        policy=setting.policy, target_concurrency=setting.target_concurrency,
        scale_down_delay_s=setting.scale_down_delay_s, tick_s=tick_s, slo_ttft_s=setting.slo_ttft_s,
        slo_tpot_s=setting.slo_tpot_s, serverlessllm_keep_alive_s=setting.serverlessllm_keep_alive_s, seed=seed,
        prefill_ahead=setting.prefill_ahead)


def check_profile(setting: BenchSetting, profile: SimProfile, measured_for: Mapping | None) -> list[str]:
    """Where the profile's own record of what it was measured for (its file's `measured_for`)
    differs from the benchmark's setting: one line each (empty: it matches, or says nothing)."""
    out = []
    if not measured_for:
        return ["the profile does not say what it was measured for (no measured_for): check it by hand"]
    want = {"preset": setting.preset, "blocks": setting.blocks, "cpu_quota": setting.cpu_quota,
            "link_mbit": setting.link_mbit, "disk_mbit": setting.disk_mbit, "h2d_mbit": setting.h2d_mbit}
    for k, v in want.items():
        if k in measured_for and measured_for[k] != v:
            out.append(f"profile measured for {k}={measured_for[k]!r}, the benchmark ran {k}={v!r}")
    return out


def measured_row(row: Mapping) -> dict[str, float | None]:
    """The compared figures of one mode of one real run (None where the run did not record one:
    runs made before `bench trace` recorded its scale operations have no scale-out times)."""
    ttft, tbt = row.get("ttft_s") or {}, row.get("tbt_s") or {}
    out = row.get("scale_out_s")
    return {"instance_seconds": row.get("instance_seconds"),
            "scale_out_s": out.get("mean") if isinstance(out, Mapping) else None,
            "ttft_p50": ttft.get("p50"), "ttft_p99": ttft.get("p99"),
            "tpot_p50": tbt.get("p50"), "tpot_p99": tbt.get("p99")}


def sim_instance_seconds(res: RunResult, replay_s: float) -> float:
    """Instance-seconds over the benchmark's window: [0, max(replay end, last request done)]."""
    end = max([replay_s, *(r.done for r in res.requests if r.done is not None)])
    return instance_seconds(res.instance_series, end)


def sim_figures(res: RunResult, setting: BenchSetting) -> tuple[dict[str, float | None], dict]:
    """(the compared figures, the simulator's whole summary) of one simulated mode."""
    summary = summarize(res, setting.slo_ttft_s, setting.slo_tpot_s)
    return ({"instance_seconds": round(sim_instance_seconds(res, setting.replay_s), 3),
             "scale_out_s": summary["scale_out_s"]["mean"],
             "ttft_p50": summary["ttft_s"]["p50"], "ttft_p99": summary["ttft_s"]["p99"],
             "tpot_p50": summary["tpot_s"]["p50"], "tpot_p99": summary["tpot_s"]["p99"]}, summary)


def compare(sim: Mapping[str, float | None], runs: Sequence[Mapping[str, float | None]],
            metrics: Sequence[Metric] = METRICS) -> dict[str, dict]:
    """Per metric: the simulated value, the real runs' values, median, range, relative error
    (sim / median - 1) and whether it is within tolerance (None: no verdict, or nothing measured)."""
    out = {}
    for metric in metrics:
        real = [float(r[metric.key]) for r in runs if r.get(metric.key) is not None]
        s = sim.get(metric.key)
        entry: dict = {"sim": s, "runs": real, "median": None, "min": None, "max": None, "rel_err": None,
                       "tolerance": metric.tolerance, "range_ok": metric.range_ok, "within": None}
        if real:
            med = statistics.median(real)
            entry.update(median=med, min=min(real), max=max(real))
            if s is not None and med > 0:
                err = s / med - 1
                entry["rel_err"] = round(err, 4)
                if metric.tolerance is not None:
                    inside = min(real) <= s <= max(real) if metric.range_ok else False
                    entry["within"] = bool(abs(err) <= metric.tolerance + 1e-12 or inside)
        out[metric.key] = entry
    return out


def validate_rows(setting: BenchSetting, measured: Sequence[Mapping], sims: Mapping[str, RunResult]) -> list[dict]:
    """One row per simulated mode: {"mode", "runs", "figures": compare(...), "sim_summary"}.
    `measured` are the bench trace JSONs (one setting), `sims` the simulated runs by mode."""
    rows = []
    for mode, res in sims.items():
        real = []
        for data in measured:
            found = [r for r in data["results"] if r.get("mode") == mode]
            if found:
                real.append(measured_row(found[0]))
        if not real:
            raise ValidationError(f"no measured run has the mode {mode!r}")
        figures, summary = sim_figures(res, setting)
        rows.append({"mode": mode, "runs": len(real), "figures": compare(figures, real), "sim_summary": summary})
    return rows


def verdicts(rows: Sequence[Mapping]) -> dict[str, int]:
    """How many (mode, metric) pairs are within tolerance, beyond it, or without a verdict."""
    out = {"within": 0, "beyond": 0, "no_verdict": 0}
    for row in rows:
        for entry in row["figures"].values():
            key = "no_verdict" if entry["within"] is None else "within" if entry["within"] else "beyond"
            out[key] += 1
    return out


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def table(rows: Sequence[Mapping], metrics: Sequence[Metric] = METRICS) -> list[str]:
    """The side-by-side text: per mode and metric, simulated, the real runs' median [min, max],
    the relative error and the verdict ("ok", "BEYOND", or "-" without one)."""
    lines = [f"{'mode':<15}{'figure':<20}{'sim':>9}{'real median':>13}{'real range':>19}{'error':>9}"
             f"{'tolerance':>14}  verdict"]
    for row in rows:
        for metric in metrics:
            e = row["figures"][metric.key]
            rng = f"[{fmt(e['min'])}, {fmt(e['max'])}]" if e["min"] is not None else "-"
            err = "-" if e["rel_err"] is None else f"{e['rel_err']:+.1%}"
            tol = "-" if metric.tolerance is None else f"{metric.tolerance:.0%}" + (" or range" if metric.range_ok
                                                                                    else "")
            verdict = "-" if e["within"] is None else "ok" if e["within"] else "BEYOND"
            if e["median"] is None:
                verdict = "not measured"
            lines.append(f"{row['mode']:<15}{metric.label:<20}{fmt(e['sim']):>9}{fmt(e['median']):>13}{rng:>19}"
                         f"{err:>9}{tol:>14}  {verdict}")
    return lines


# --- a `layercast bench scale --burst` case ------------------------------------------------------

BURST_METRICS: tuple[Metric, ...] = (
    Metric("all_ready_s", "all loaded s", 0.15),
    Metric("burst_first_token_s", "burst first token", 0.25, range_ok=True),
    Metric("new_capacity_first_token_s", "new capacity 1st tok", 0.25, range_ok=True),
)
BURST_PROMPT_TOKENS = 8  # "burst <8 hex digits>" (benchmarks/bench_scale.py) in the demo tokenizer: a few tokens
BURST_WARM_S = 5.0  # the decision comes no earlier (and 1 s after the from-instances loaded)


@dataclass(frozen=True)
class BurstSetting:
    workers: int
    from_n: int
    to_n: int
    burst: int
    max_tokens: int
    cpu_quota: float | None
    link_mbit: float | None
    disk_mbit: float | None
    h2d_mbit: float | None
    modes: tuple[str, ...]
    prefill_ahead: bool = False  # as BenchSetting's


def burst_setting(data: Mapping) -> BurstSetting:
    """The setting of one `layercast bench scale --burst N --json` result."""
    if not isinstance(data, Mapping):
        raise ValidationError("not a `layercast bench scale --json` result: not a JSON object")
    try:
        if not int(data["burst"]):
            raise ValidationError("a `bench scale` result without --burst: no burst to compare")
        prof = data.get("profile") or {}
        return BurstSetting(int(data["workers"]), int(data["from"]), int(data["to"]), int(data["burst"]),
                            int(data["max_tokens"]), _cap(prof.get("cpu_quota")), _cap(prof.get("link_mbit")),
                            _cap(prof.get("disk_read_mbit")), _cap(prof.get("host_to_device_mbit")),
                            tuple(str(r["mode"]) for r in data["results"]), bool(data.get("prefill_ahead", False)))
    except KeyError as e:
        raise ValidationError(f"not a `layercast bench scale --json` result: no {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ValidationError(f"bench scale result: {e}") from None


def burst_trials(data: Mapping, mode: str) -> list[dict[str, float | None]]:
    """The compared figures of each trial of one mode (every trial, not only the median one)."""
    found = [r for r in data.get("results", []) if r.get("mode") == mode]
    if not found:
        raise ValidationError(f"the bench scale result has no mode {mode!r}")
    trials = found[0].get("trials") or [found[0]]
    return [{m.key: t.get(m.key) for m in BURST_METRICS} for t in trials if not t.get("error")]


def simulate_burst(setting: BurstSetting, mode: str, profile: SimProfile, *, prompt_tokens: int = BURST_PROMPT_TOKENS,
                   seed: int = 0, tick_s: float = 0.1) -> dict[str, float | None]:
    """`bench scale --burst`: `from_n` instances serve (settled), then at one instant the planner is
    asked for `to_n` (the load-monitor kept out) and `burst` requests arrive. Seconds from the
    decision: the last of the burst's first tokens, the first token new capacity served (an
    instance or pipeline that was not serving before), and the last target loaded."""
    from libs.sim.fleet import Simulation

    cfg = FleetConfig(nodes=setting.workers, mode=mode, min_instances=setting.from_n, max_instances=setting.to_n,
                      keep_alive_s=1e9, tick_s=tick_s, seed=seed, horizon_after_s=600.0,
                      prefill_ahead=setting.prefill_ahead)
    # bench scale decides once the deployment settled (its from-instances loaded: serverlessllm's from
    # disk; the parameter pool's copies in place), then 1 s more; the run is deterministic, so a
    # first run without the burst says when.
    warmup = Simulation(cfg, profile, []).run()
    settled = max([o["done_s"] + o["decided"] for o in warmup.scale_ops] + [f["done_s"] for f in warmup.pool_fills],
                  default=0.0)
    t0 = max(BURST_WARM_S, settled + 1.0)
    sim = Simulation(cfg, profile, [(t0, prompt_tokens, setting.max_tokens)] * setting.burst)
    warm: set[str] = set()
    sim.q.at(t0, lambda: warm.update(sim.serving_instances()))
    sim.force_scale(t0, setting.to_n)
    res = sim.run()
    firsts = [r.first_token for r in res.requests]
    new = [r.first_token for r in res.requests if r.first_token is not None and r.instance not in warm]
    ups = [o for o in res.scale_ops if o["decided"] == t0]
    return {"all_ready_s": ups[0]["last_loaded_s"] if ups else None,
            "burst_first_token_s": (max(firsts) - t0) if all(f is not None for f in firsts) else None,
            "new_capacity_first_token_s": (min(new) - t0) if new else None}


def compare_burst(sim: Mapping[str, float | None], trials: Sequence[Mapping[str, float | None]]) -> dict[str, dict]:
    """As :func:`compare`, over the burst's figures (:data:`BURST_METRICS`) and the trials."""
    return compare(sim, trials, BURST_METRICS)
