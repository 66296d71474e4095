"""`layercast simulate`: replay a trace through the fleet simulator (libs.sim), per scaling mode."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

TRACE_ATTRIBUTION = ("Azure LLM inference traces 2023 (Azure/AzurePublicDataset, CC-BY-4.0)")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(1)


def simulate(
    trace: Path = typer.Argument(..., help="A trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."),
    nodes: int = typer.Option(8, "--nodes", help="Workers (one GPU each)."),
    profile: str = typer.Option("h100-200g", "--profile",
                                help="A profile file (JSON), or the name of one in libs/sim/profiles/."),
    modes: str = typer.Option("layercast,binomial,serverlessllm,faasnet,ideal", "--modes",
                              help="Comma-separated scaling modes (libs.planning.scaleout.MODES)."),
    leaves: int = typer.Option(1, "--leaves", help="Leaf switches the workers are spread over."),
    uplink_gbps: float | None = typer.Option(None, "--uplink-gbps",
                                             help="A leaf's uplink to the spine in all (default: non-blocking)."),
    scaleup_group: int = typer.Option(1, "--scaleup-group", help="Workers per scale-up group (1: none)."),
    models: int = typer.Option(1, "--models", help="Models deployed; each request goes to one at random (seeded)."),
    sharing: str = typer.Option("exclusive", "--sharing", help="exclusive | mesh (the gateway's routing order)."),
    max_instances: int | None = typer.Option(None, help="Per model (default: --nodes)."),
    keep_alive_s: float = typer.Option(60.0, help="Deployments' keep-alive."),
    target_concurrency: int = typer.Option(8, help="The load-monitor's concurrency target."),
    tick_s: float = typer.Option(0.1, "--tick", help="The load-monitor's tick."),
    slo_ttft_s: float = typer.Option(2.0, "--slo-ttft", help="TTFT SLO (s)."),
    slo_tpot_s: float = typer.Option(0.25, "--slo-tpot", help="Mean time per output token SLO (s)."),
    start_s: float = typer.Option(0.0, help="Skip the trace's first seconds."),
    duration_s: float | None = typer.Option(None, help="Then keep this many seconds (default: all)."),
    time_scale: float = typer.Option(1.0, help=">1 compresses time."),
    rate_scale: float = typer.Option(1.0, help="Fraction of rows kept (seeded thinning)."),
    max_prompt_tokens: int | None = typer.Option(None, help="Scale prompt lengths under this."),
    max_output_tokens: int | None = typer.Option(None, help="Clip output lengths to this."),
    horizon_s: float = typer.Option(600.0, "--horizon-s",
                                    help="Simulate this long after the last arrival; requests unfinished then are lost."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    plot: Path | None = typer.Option(None, "--plot", help="Write instances-over-time and TTFT-CDF plots here."),
    validate: bool = typer.Option(False, "--validate", help="Simulated against measured `layercast bench trace` "
                                  "runs of the same setting, side by side (with --measured: read them; else run "
                                  "them: --runs, --bench-args). --profile should be measured here "
                                  "(`layercast simulate-profile`)."),
    measured: list[Path] = typer.Option([], "--measured", help="With --validate: a `bench trace --json` result "
                                        "(repeat, or list the files after TRACE). Its setting is simulated."),
    more_measured: list[Path] = typer.Argument(None, hidden=True),
    runs: int = typer.Option(1, "--runs", min=1, help="With --validate, no --measured: bench trace runs to make, "
                             "with this command's --modes, --nodes (workers), transform flags, --keep-alive-s, "
                             "--target-concurrency and --seed."),
    bench_args: str = typer.Option("", "--bench-args", help="With --validate, no --measured: more `bench trace` "
                                   "flags, one string (e.g. '--preset small-40k --blocks 4 --emulate "
                                   "--cpu-quota 0.4 --scale-down-delay-s 5')."),
    burst_profile: str | None = typer.Option(None, "--burst-profile", help="With --validate: the profile for "
                                             "`bench scale --burst` results among --measured (default: --profile)."),
    measured_out: Path | None = typer.Option(None, "--measured-out", help="With --validate: keep the bench "
                                             "trace JSONs made here (run1.json, ...)."),
) -> None:
    """Simulate a trace on N nodes per scaling mode, running layercast's own decisions (libs.sim)."""
    if validate or measured or more_measured:
        if not validate:
            _fail("--measured (and files after TRACE) go with --validate")
        files = [*measured, *(more_measured or [])]
        if more_measured and not measured:
            _fail(f"unexpected arguments after TRACE: {' '.join(map(str, more_measured))} (measured files go "
                  "after --measured)")
        if not files:
            files = _run_bench(trace, runs, bench_args, measured_out, modes=modes, nodes=nodes,
                               time_scale=time_scale, rate_scale=rate_scale, start_s=start_s, duration_s=duration_s,
                               max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
                               keep_alive_s=keep_alive_s, target_concurrency=target_concurrency, seed=seed)
        _validate(trace, files, profile, modes, tick_s, seed, as_json, burst_profile)
        return
    from libs.planning.trace import Transform, apply_transform, parse_trace
    from libs.sim.fleet import FleetConfig, Simulation
    from libs.sim.profile import ProfileError, load_profile
    from libs.sim.report import plot as plot_runs
    from libs.sim.report import summarize

    try:
        prof = load_profile(profile)
        tf = Transform(time_scale=time_scale, rate_scale=rate_scale, max_prompt_tokens=max_prompt_tokens,
                       max_output_tokens=max_output_tokens, start_s=start_s, duration_s=duration_s, seed=seed)
        rows = parse_trace(trace)
        reqs = [(r.send_at_s, r.prompt_tokens, r.output_tokens) for r in apply_transform(rows, tf)]
        names = [x.strip() for x in modes.split(",") if x.strip()]
        if not names:
            _fail("--modes names no mode")
        cfgs = [FleetConfig(nodes=nodes, mode=mode, leaves=leaves, uplink_gbps=uplink_gbps,
                            scaleup_group=scaleup_group, models=models, sharing=sharing,
                            max_instances=max_instances, keep_alive_s=keep_alive_s,
                            target_concurrency=target_concurrency, tick_s=tick_s, slo_ttft_s=slo_ttft_s,
                            slo_tpot_s=slo_tpot_s, seed=seed, horizon_after_s=horizon_s) for mode in names]
    except (ProfileError, ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if not reqs:
        _fail("the trace window holds no request")
    rows_out, runs = [], []
    wall0 = time.perf_counter()
    for cfg in cfgs:
        t0 = time.perf_counter()
        sim = Simulation(cfg, prof, reqs)
        last = reqs[-1][0]

        def progress(t: float, mode: str = cfg.mode) -> None:
            print(f"\r{mode}: simulated {t:,.0f} of {last:,.0f} s", end="", file=sys.stderr, flush=True)

        res = sim.run(progress=progress)
        print(f"\r{cfg.mode}: done in {time.perf_counter() - t0:.1f} s wall" + " " * 20, file=sys.stderr)
        row = summarize(res, slo_ttft_s, slo_tpot_s)
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows_out.append(row)
        runs.append(res)
    settings = {"nodes": nodes, "profile": prof.name, "leaves": leaves, "uplink_gbps": uplink_gbps,
                "scaleup_group": scaleup_group, "models": models, "sharing": sharing,
                "max_instances": max_instances or nodes, "keep_alive_s": keep_alive_s,
                "target_concurrency": target_concurrency, "tick_s": tick_s, "seed": seed, "horizon_s": horizon_s,
                "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}, "transform": {
                    "start_s": start_s, "duration_s": duration_s, "time_scale": time_scale,
                    "rate_scale": rate_scale, "max_prompt_tokens": max_prompt_tokens,
                    "max_output_tokens": max_output_tokens}}
    out = {"trace": str(trace), "attribution": TRACE_ATTRIBUTION, "requests": len(reqs), "settings": settings,
           "profile_values": dict(prof.values), "modes": rows_out,
           "wall_s": round(time.perf_counter() - wall0, 2)}
    if plot is not None:
        plot.mkdir(parents=True, exist_ok=True)
        title = (f"{trace.name} ({TRACE_ATTRIBUTION}), {len(reqs)} requests, {nodes} nodes, profile {prof.name}")
        path = plot_runs(runs, str(plot / "simulate.png"), title, slo_ttft_s)
        out["plot"] = path
        if path is None:
            print("no plots: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print(f"{trace.name}: {len(reqs)} requests on {nodes} nodes, profile {prof.name} ({TRACE_ATTRIBUTION})")
    print(f"{'mode':<15}{'ttft p50':>9}{'p90':>8}{'p99':>8}{'tpot p50':>9}{'p99':>8}{'slo':>7}{'inst-s':>10}"
          f"{'outs':>6}{'out s':>8}{'lost':>6}{'wall':>7}")
    for r in rows_out:
        t, p = r["ttft_s"], r["tpot_s"]

        def f(x: float | None, w: int, d: int = 3) -> str:
            return f"{'-' if x is None else f'{x:.{d}f}':>{w}}"

        print(f"{r['mode']:<15}{f(t['p50'], 9)}{f(t['p90'], 8)}{f(t['p99'], 8)}{f(p['p50'], 9, 4)}{f(p['p99'], 8, 4)}"
              f"{f(r['slo_attainment'], 7)}{f(r['instance_seconds'], 10, 0)}{r['scale_outs']:>6}"
              f"{f(r['scale_out_s']['mean'], 8, 2)}{r['requests_lost']:>6}{r['wall_s']:>7.1f}")
        for note in r["notes"]:
            print(f"  {r['mode']}: {note}")


def _run_bench(trace: Path, runs: int, bench_args: str, keep: Path | None, **flags: object) -> list[Path]:
    """`layercast bench trace ... --json` `runs` times (subprocesses: the CLI does not import the
    benchmarks); the JSON files it wrote."""
    import shlex
    import subprocess
    import tempfile

    argv = [sys.executable, "-c", "from services.cli import main; main()", "bench", "trace", str(trace),
            "--modes", str(flags["modes"]), "--workers", str(flags["nodes"]),
            "--time-scale", f"{flags['time_scale']:g}", "--rate-scale", f"{flags['rate_scale']:g}",
            "--start-s", f"{flags['start_s']:g}", "--duration-s", f"{flags['duration_s'] or 0:g}",
            "--keep-alive-s", f"{flags['keep_alive_s']:g}", "--target-concurrency", str(flags["target_concurrency"]),
            "--seed", str(flags["seed"]), "--json"]
    for flag, key in (("--max-prompt-tokens", "max_prompt_tokens"), ("--max-output-tokens", "max_output_tokens")):
        if flags[key] is not None:
            argv += [flag, str(flags[key])]
    try:
        argv += shlex.split(bench_args)
    except ValueError as e:
        _fail(f"--bench-args: {e}")
    out_dir = keep or Path(tempfile.mkdtemp(prefix="lc-validate-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(1, runs + 1):
        print(f"validate: bench trace run {i} of {runs}: {shlex.join(argv[3:])}", file=sys.stderr, flush=True)
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            _fail(f"bench trace run {i} failed (exit {done.returncode}); its stderr is above")
        text = done.stdout
        path = out_dir / f"run{i}.json"
        path.write_text(text[text.index("{"):] if "{" in text else text)
        files.append(path)
    return files


def _read_profile(profile: str) -> tuple[object, dict]:
    """The profile and its file's `measured_for` (empty for a committed published profile)."""
    from libs.sim.profile import load_profile

    prof = load_profile(profile)
    try:
        raw = json.loads(Path(profile).read_text()) if Path(profile).is_file() else {}
    except (json.JSONDecodeError, OSError):
        raw = {}
    return prof, (raw.get("measured_for") or {}) if isinstance(raw, dict) else {}


def _validate(trace: Path, files: list[Path], profile: str, modes: str, tick_s: float, seed: int,
              as_json: bool, burst_profile: str | None = None) -> None:
    """Simulate the measured runs' setting from `profile` and print both side by side. `bench trace`
    results are runs of one trace setting; `bench scale --burst` results (told apart by their
    `burst` key) are a burst case each, simulated from `burst_profile` (default: `profile`)."""
    from libs.planning.trace import apply_transform, parse_trace
    from libs.sim import validate as v
    from libs.sim.fleet import Simulation
    from libs.sim.profile import ProfileError

    measured, settings, bursts = [], [], []
    for f in files:
        try:
            data = json.loads(Path(f).read_text())
            if isinstance(data, dict) and "burst" in data and "transform" not in data:
                bursts.append((f, data, v.burst_setting(data)))
                continue
            settings.append(v.bench_setting(data))
        except FileNotFoundError:
            _fail(f"no measured file {f}")
        except json.JSONDecodeError as e:
            _fail(f"{f}: not JSON: {e}")
        except v.ValidationError as e:
            _fail(f"{f}: {e}")
        measured.append(data)
    wanted = [x.strip() for x in modes.split(",") if x.strip()]
    out: dict = {"trace": str(trace), "attribution": TRACE_ATTRIBUTION, "measured": [str(f) for f in files],
                 "tolerances": {m.key: {"relative": m.tolerance, "or_inside_range": m.range_ok}
                                for m in (*v.METRICS, *v.BURST_METRICS)}}
    t0 = time.perf_counter()
    text: list[str] = []
    if measured:
        try:
            setting = v.same_setting(settings)
            prof, measured_for = _read_profile(profile)
            rows = parse_trace(trace)
        except (v.ValidationError, ProfileError, ValueError, FileNotFoundError) as e:
            _fail(str(e))
        reqs = [(r.send_at_s, r.prompt_tokens, r.output_tokens) for r in apply_transform(rows, setting.transform)]
        if len(reqs) != setting.requests:
            _fail(f"{trace} gives {len(reqs)} requests with the measured runs' transform, they sent "
                  f"{setting.requests}: not the trace they replayed")
        in_all = [m for m in setting.modes if all(any(r["mode"] == m for r in d["results"]) for d in measured)]
        names = [m for m in in_all if m in wanted] or in_all
        warnings = v.check_profile(setting, prof, measured_for)
        sims = {mode: Simulation(v.fleet_config(setting, mode, tick_s=tick_s, seed=seed), prof, reqs).run()
                for mode in names}
        try:
            out_rows = v.validate_rows(setting, measured, sims)
        except v.ValidationError as e:
            _fail(str(e))
        out["profile"], out["profile_description"], out["profile_warnings"] = prof.name, prof.description, warnings
        out["setting"] = {"requests": setting.requests, "workers": setting.workers, "replay_s": setting.replay_s,
                          "keep_alive_s": setting.keep_alive_s, "scale_down_delay_s": setting.scale_down_delay_s,
                          "target_concurrency": setting.target_concurrency, "policy": setting.policy,
                          "serverlessllm_keep_alive_s": setting.serverlessllm_keep_alive_s,
                          "slo": {"ttft_s": setting.slo_ttft_s, "tpot_s": setting.slo_tpot_s},
                          "cpu_quota": setting.cpu_quota, "preset": setting.preset, "blocks": setting.blocks}
        out["modes"], out["verdicts"] = out_rows, v.verdicts(out_rows)
        text += [f"{trace.name}: {setting.requests} requests, {setting.workers} workers; simulated from profile "
                 f"{prof.name} against {len(measured)} measured run(s) ({TRACE_ATTRIBUTION})",
                 *(f"warning: {w}" for w in warnings), *v.table(out_rows)]
        counts = out["verdicts"]
        text.append(f"{counts['within']} within tolerance, {counts['beyond']} beyond, "
                    f"{counts['no_verdict']} without a verdict")
    if bursts:
        try:
            bprof, _ = _read_profile(burst_profile or profile)
        except ProfileError as e:
            _fail(str(e))
        out["burst_profile"], out["bursts"] = bprof.name, []
        for f, data, bs in bursts:
            brows = []
            for mode in [m for m in bs.modes if m in wanted] or list(bs.modes):
                sim = v.simulate_burst(bs, mode, bprof, tick_s=tick_s, seed=seed)
                trials = v.burst_trials(data, mode)
                brows.append({"mode": mode, "runs": len(trials), "figures": v.compare_burst(sim, trials)})
            out["bursts"].append({"measured": str(f), "setting": {
                "workers": bs.workers, "from": bs.from_n, "to": bs.to_n, "burst": bs.burst,
                "max_tokens": bs.max_tokens, "cpu_quota": bs.cpu_quota}, "modes": brows,
                "verdicts": v.verdicts(brows)})
            text += ["", f"{f}: bench scale --burst {bs.burst}, {bs.from_n} -> {bs.to_n} of {bs.workers} workers; "
                     f"simulated from profile {bprof.name} against each trial",
                     *v.table(brows, v.BURST_METRICS)]
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    print("\n".join(text))
