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
) -> None:
    """Simulate a trace on N nodes per scaling mode, running layercast's own decisions (libs.sim)."""
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
