"""`layercast simulate-figures`: the papers' curves at their scale (libs.sim.figures), as JSON + PNG."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

# The shared trace beside the checkout (../shared/traces, as the README's commands name it).
DEFAULT_TRACE = Path("../shared/traces/azure_llm_code_2023_first30min.csv")


def simulate_figures(
    out: Path = typer.Option(Path("docs/sim/figures"), "--out", help="Where each figure's JSON and PNG go."),
    profile: str = typer.Option("h100-200g", "--profile",
                                help="A profile file (JSON), or the name of one in libs/sim/profiles/."),
    only: str = typer.Option("", "--only", help="Comma-separated figures (default: all): multicast_vs_n, burst, "
                                                "chain_topology, placement, mesh_capacity."),
    trace: Path = typer.Option(DEFAULT_TRACE, "--trace", help="The trace mesh_capacity replays (its first 10 "
                                                             "minutes, 2x compressed)."),
) -> None:
    """Regenerate docs/sim/figures: multicast vs N, the 50-request burst, chains on a leaf-spine
    fabric, locality-aware placement, LLM-Mesh sharing, each from layercast's own decision code."""
    from libs.planning.trace import Transform, apply_transform, parse_trace
    from libs.sim import figures as f
    from libs.sim.profile import ProfileError, load_profile

    try:
        prof = load_profile(profile)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    names = [x.strip() for x in only.split(",") if x.strip()] or list(f.FIGURES)
    bad = [n for n in names if n not in f.FIGURES]
    if bad:
        print(f"error: unknown figure {bad[0]!r}; choose from {', '.join(f.FIGURES)}", file=sys.stderr)
        raise typer.Exit(1)
    for name in names:
        t0 = time.perf_counter()
        if name == "mesh_capacity":
            try:
                rows = parse_trace(trace)
            except (OSError, ValueError) as e:
                print(f"error: {trace}: {e}", file=sys.stderr)
                raise typer.Exit(1) from None
            reqs = [(r.send_at_s, r.prompt_tokens, r.output_tokens)
                    for r in apply_transform(rows, Transform(time_scale=2.0, duration_s=600.0))]
            data = f.fig_mesh_capacity(prof, reqs)
            data["trace"] = {"file": trace.name, "transform": "first 600 s, time_scale 2", "requests": len(reqs),
                             "attribution": "Azure LLM inference traces 2023 (Azure/AzurePublicDataset, CC-BY-4.0)"}
        else:
            data = getattr(f, f"fig_{name}")(prof)
        data["profile"] = prof.name
        path = f.write_figure(name, data, out)
        print(f"{name}: {path} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
