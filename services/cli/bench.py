"""`layercast bench ...`: benchmarks. Each prints one JSON object (with --json)."""

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmarks; each prints one JSON object with --json.", no_args_is_help=True)


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: imports, caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def _planners(n_blocks: int) -> dict[str, Callable[[int], Callable[[], object]]]:
    """Each entry builds, for n workers, a thunk that generates one plan."""
    from libs.planning.chain import Gpu, chain_ids, plan_chains
    from libs.planning.estimate import Bandwidths, ModelSpec, Tier, WorkerView, choose_server
    from libs.planning.multicast import (
        binary_tree_schedule,
        binomial_schedule,
        chain_schedule,
        execution_pipelines,
        kway_schedule,
        kway_subgroups,
        pipeline_ready_steps,
        star_schedule,
    )
    from libs.planning.multicast_choice import choose_multicast
    from libs.planning.zigzag import simulate_zigzag_queue

    gib = 1 << 30

    def k_for(n: int) -> int:
        return max(1, min(4, n // 2))

    def chain(n: int) -> Callable[[], object]:
        # 4 sources, targets spread over 4 leaves in NVLink groups of 2.
        k = k_for(n)
        gpus = [
            Gpu(i, f"h{i // 8}", f"leaf{(i // 8) % 4}", f"nv{i // 2}", 100.0 + 100.0 * (i % 3 == 0))
            for i in range(n)
        ]
        srcs, tgts = gpus[:k], gpus[k:]

        def run() -> object:
            return chain_schedule(chain_ids(plan_chains(srcs, tgts, len(tgts))), n_blocks)

        return run

    def kway_pipelines(n: int) -> Callable[[], object]:
        k = k_for(n)

        def run() -> object:
            sched = kway_schedule(n, n_blocks, k)
            return pipeline_ready_steps(sched, n_blocks, execution_pipelines(kway_subgroups(n, k)))

        return run

    def server(n: int) -> Callable[[], object]:
        bw = Bandwidths(host_to_device=25e9, ssd_to_host=5e9, network_to_host=12.5e9)
        model = ModelSpec("m", (gib,) * n_blocks)
        workers = [
            WorkerView(
                f"w{i}",
                bw,
                free_gpus=i % 2,
                blocks={"m": {b: (Tier.HOST if (i + b) % 3 == 0 else Tier.SSD) for b in range(n_blocks) if i % 4}},
                queue_s=0.1 * (i % 5),
            )
            for i in range(n)
        ]
        return lambda: choose_server(model, workers)

    return {
        "binomial": lambda n: lambda: binomial_schedule(n, n_blocks),
        "kway": lambda n: lambda: kway_schedule(n, n_blocks, k_for(n)),
        "kway_pipelines": kway_pipelines,
        "chain": chain,
        "star": lambda n: lambda: star_schedule(n, n_blocks),
        "binary_tree": lambda n: lambda: binary_tree_schedule(n, n_blocks),
        "choose_multicast": lambda n: lambda: choose_multicast(
            k_for(n), n - k_for(n), 16 * gib, n_blocks, 100.0, live=True
        ),
        "choose_server": server,
        # n queued batches of a 32-layer model, one layer load = 6 layer computations.
        "zigzag_queue": lambda n: lambda: simulate_zigzag_queue(n, 32, 6.0),
    }


@bench_app.command("plan")
def plan(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    sizes: str = typer.Option("8,64,512", help="Comma-separated worker counts."),
    n_blocks: int = typer.Option(16, help="Model blocks per plan."),
    repeat: int = typer.Option(5, help="Timed runs per point (median reported)."),
    bound_ms: float = typer.Option(50.0, help="Budget a 64-worker plan must meet."),
) -> None:
    """Plan-generation time of every planner in libs/planning (median ms)."""
    ns = [int(x) for x in sizes.split(",") if x.strip()]
    plan_ms: dict[str, dict[str, float]] = {}
    for name, build in _planners(n_blocks).items():
        plan_ms[name] = {str(n): round(_median_ms(build(n), repeat), 3) for n in ns}

    from libs.planning.zigzag import zigzag_ilp

    ilp_ms = round(_median_ms(lambda: zigzag_ilp(7, 7, 6.0), repeat), 3)
    at_64 = [v["64"] for v in plan_ms.values() if "64" in v]
    result = {
        "plan_ms": plan_ms,
        "zigzag_ilp_7x7_ms": ilp_ms,
        "n_blocks": n_blocks,
        "repeat": repeat,
        "bound_ms": bound_ms,
        "all_64_under_bound": bool(at_64) and all(v < bound_ms for v in at_64),
    }
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plan generation, median ms ({n_blocks} blocks)")
    table.add_column("planner")
    for n in ns:
        table.add_column(f"{n} workers", justify="right")
    for name, row in plan_ms.items():
        table.add_row(name, *(f"{row[str(n)]:.3f}" for n in ns))
    console = Console()
    console.print(table)
    console.print(f"zigzag ILP 7x7: {ilp_ms:.3f} ms; all 64-worker plans under {bound_ms} ms: "
                  f"{result['all_64_under_bound']}")


@bench_app.command("load")
def load(
    path: Path = typer.Argument(None, help="A block checkpoint (default: the 200m demo, created once)."),
    hf: Path = typer.Option(None, "--hf", help="Its source Hugging Face folder (default: PATH/../hf)."),
    repeat: int = typer.Option(3, "--repeat", help="Trials per method; the best is reported."),
    chunk_mib: int = typer.Option(0, "--chunk-mib", help="Loader chunk size (0: the default)."),
    threads: int = typer.Option(0, "--threads", help="Loader reader threads (0: the default)."),
    device: str = typer.Option("auto", "--device", help="Target device of the loader (auto: cuda if present)."),
    do_sweep: bool = typer.Option(False, "--sweep", help="Also sweep chunk size x threads for the cold load."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """Cold/warm/host-tier load bandwidth and time to first logits against the raw disk and the usual loaders."""
    from libs.checkpoint.fastload import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS
    from services.cli.bench_load import demo_paths, run_load_benchmark, sweep

    if path is None:
        path, default_hf = demo_paths(state_dir)
        hf = hf or default_hf
    hf, device = _checkpoint_and_device(path, hf, device)
    result = run_load_benchmark(path, hf, repeat, (chunk_mib << 20) or DEFAULT_CHUNK_BYTES,
                                threads or DEFAULT_THREADS, device)
    if do_sweep:
        result["sweep_cold_gbps"] = sweep(path, repeat)
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console

    Console().print_json(json.dumps(result))


def _checkpoint_and_device(path: Path, hf: Path | None, device: str) -> tuple[Path, str]:
    """Check a benchmark's checkpoint and its HF source folder (default PATH/../hf); resolve device auto."""
    import torch

    from libs.checkpoint import is_block_checkpoint

    if not is_block_checkpoint(path):
        raise typer.BadParameter(f"{path} is not a block checkpoint (convert it with `layercast model convert`)")
    hf = hf or path.parent / "hf"
    if not (hf / "config.json").is_file():
        raise typer.BadParameter(f"{hf} is not a Hugging Face folder; pass the source folder with --hf")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return hf, device


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers") from None


@bench_app.command("multicast")
def multicast(
    nodes: int = typer.Option(8, "--nodes", min=2, help="Nodes in the emulated cluster, sources included."),
    size_mb: float = typer.Option(256, "--size-mb", min=0.001, help="Model size in MiB."),
    blocks: int = typer.Option(16, "--blocks", min=1, help="Blocks the model is cut into."),
    link_mbit: float = typer.Option(400, "--link-mbit", min=1, help="Per-node link rate R (both directions)."),
    algorithms: str = typer.Option("star,binary-tree,chain,binomial", "--algorithms"),
    ks: str = typer.Option("1,2,4", "--k", help="Source counts for chain and binomial (k-way)."),
    chunk_kib: int = typer.Option(1024, "--chunk-kib", min=4, help="Frame size of the TCP transport."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Runs per algorithm; the median is reported."),
    cpu_quota: float = typer.Option(None, "--cpu-quota", help="CPUs per node (cgroup quota); default none."),
    mtu: int = typer.Option(9000, "--mtu", help="Link MTU (jumbo frames as in datacenter fabrics)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every multicast algorithm on one emulated cluster (root: netns + tc), against its bounds."""
    from services.cli.bench_multicast import ALGORITHMS, run_multicast_benchmark
    from services.cli.emulation import can_emulate

    ok, why = can_emulate()
    if not ok:
        raise typer.BadParameter(f"cannot emulate a cluster here: {why}")
    algs = [a.strip() for a in algorithms.split(",") if a.strip()]
    bad = [a for a in algs if a not in ALGORITHMS]
    if bad:
        raise typer.BadParameter(f"unknown algorithms {bad}; choose from {', '.join(ALGORITHMS)}")
    result = run_multicast_benchmark(nodes, size_mb, blocks, link_mbit, algs, _int_list(ks), chunk_kib, repeat,
                                     cpu_quota, mtu)
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"multicast of {size_mb} MiB in {blocks} blocks to {nodes} nodes at {link_mbit} Mbit/s")
    for col in ("algorithm", "k", "completion s", "schedule bound s", "measured/bound", "measured/(M/R)"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(r["algorithm"], str(r["k"]), f"{r['completion_s']:.3f}", f"{r['schedule_bound_s']:.3f}",
                      f"{r['ratio_to_schedule_bound']:.3f}", f"{r['ratio_to_lower_bound']:.3f}")
    Console().print(table)


@bench_app.command("engine")
def engine(
    path: Path = typer.Argument(None, help="A block checkpoint (default: the small demo, 4 blocks, built once)."),
    hf: Path = typer.Option(None, "--hf", help="Its source Hugging Face folder (default: PATH/../hf)."),
    new_tokens: int = typer.Option(32, "--new-tokens", min=2, help="Tokens decoded per request."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto (cuda if present)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """Batched decode at batch 1/4/16/32, prefill, and 2/4-stage pipelines against sequential generate()."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint, is_block_checkpoint
    from services.cli.bench_engine import run_engine_benchmark

    if path is None:
        root = state_dir.resolve() / "bench-engine-small"
        path = root / "blocks"
        if not is_block_checkpoint(path):
            create_demo_checkpoint(root / "hf", preset="small", arch="llama", seed=0)
            convert_checkpoint(root / "hf", path, 4)
    hf, device = _checkpoint_and_device(path, hf, device)
    result = run_engine_benchmark(path, hf, new_tokens, device)
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console

    Console().print_json(json.dumps(result))
