"""`layercast bench ...`: benchmarks. Each prints one JSON object (with --json)."""

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import typer

bench_app = typer.Typer(help="Benchmarks; each prints one JSON object with --json.", no_args_is_help=True,
                        add_completion=False)


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
    peers: bool = typer.Option(True, "--peers/--no-peers",
                               help="Also run runai-model-streamer and fastsafetensors where installed "
                                    "(the bench-peers extra); a missing one is skipped with its reason."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """Cold/warm/host-tier load bandwidth and time to first logits against the raw disk and the usual loaders."""
    from libs.checkpoint.fastload import DEFAULT_CHUNK_BYTES, DEFAULT_THREADS
    from benchmarks.bench_load import demo_paths, run_load_benchmark, sweep

    if path is None:
        path, default_hf = demo_paths(state_dir)
        hf = hf or default_hf
    hf, device = _checkpoint_and_device(path, hf, device)
    result = run_load_benchmark(path, hf, repeat, (chunk_mib << 20) or DEFAULT_CHUNK_BYTES,
                                threads or DEFAULT_THREADS, device, peers)
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


# The leaf-spine flags (libs/cluster/emulation.py), shared by every command that emulates a cluster.
def _leaves_option(default: int | None = None):
    return typer.Option(default, "--leaves", min=1, help="Emulated: workers round-robin over this many leaf "
                                                         "bridges joined by a spine (default 1: one flat switch).")


def _uplink_option():
    return typer.Option(None, "--uplink-mbit", min=0, help="Emulated, --leaves >= 2: each leaf's uplink to the "
                                                           "spine, each direction (default / 0: not capped).")


def _scaleup_option(default: int | None = None):
    return typer.Option(default, "--scaleup-group-size", min=1,
                        help="Emulated: G consecutive workers of a leaf form a scale-up group at 4x the link rate "
                             "(default 1: none).")


@bench_app.command("multicast")
def multicast(
    nodes: int = typer.Option(8, "--nodes", "--workers", min=2, help="Nodes in the emulated cluster, sources "
                                                                      "included."),
    size_mb: float = typer.Option(256, "--size-mb", min=0.001, help="Model size in MiB."),
    blocks: int = typer.Option(16, "--blocks", min=1, help="Blocks the model is cut into."),
    link_mbit: float = typer.Option(400, "--link-mbit", min=1, help="Per-node link rate R (both directions)."),
    algorithms: str = typer.Option("star,binary-tree,chain,binomial", "--algorithms", "--modes"),
    ks: str = typer.Option("1,2,4", "--k", help="Source counts for chain and binomial (k-way)."),
    chunk_kib: int = typer.Option(1024, "--chunk-kib", min=4, help="Frame size of the TCP transport."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Runs per algorithm; the median is reported."),
    cpu_quota: float = typer.Option(None, "--cpu-quota", help="CPUs per node (cgroup quota); default none."),
    mtu: int = typer.Option(9000, "--mtu", help="Link MTU (jumbo frames as in datacenter fabrics)."),
    leaves: int = _leaves_option(1),
    uplink_mbit: float = _uplink_option(),
    scaleup_group_size: int = _scaleup_option(1),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every multicast algorithm on one emulated cluster (root: netns + tc), against its bounds."""
    from benchmarks.bench_multicast import run_multicast_benchmark
    from libs.planning.multicast import ALGORITHM_ALIASES, MULTICAST_ALGORITHMS
    from libs.cluster.emulation import EmulationProfile, can_emulate

    try:  # the topology flags first: a bad combination is refused before anything runs
        EmulationProfile(link_mbit=link_mbit, leaves=leaves, uplink_mbit=uplink_mbit or None,
                         scaleup_group_size=scaleup_group_size)
        if leaves > nodes:
            raise ValueError(f"{leaves} leaves for {nodes} nodes: a leaf would have no node")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    ok, why = can_emulate()
    if not ok:
        raise typer.BadParameter(f"cannot emulate a cluster here: {why}")
    algs = [a.strip() for a in algorithms.split(",") if a.strip()]
    bad = [a for a in algs if a not in MULTICAST_ALGORITHMS and a not in ALGORITHM_ALIASES]
    if bad:
        raise typer.BadParameter(f"unknown algorithms {bad}; choose from {', '.join(MULTICAST_ALGORITHMS)}")
    try:
        result = run_multicast_benchmark(nodes, size_mb, blocks, link_mbit, algs, _int_list(ks), chunk_kib, repeat,
                                         cpu_quota, mtu, leaves=leaves, uplink_mbit=uplink_mbit or None,
                                         scaleup_group_size=scaleup_group_size)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    where = "" if leaves == 1 else f" on {leaves} leaves (uplinks {uplink_mbit or 'uncapped'} Mbit/s)"
    table = Table(title=f"multicast of {size_mb} MiB in {blocks} blocks to {nodes} nodes at {link_mbit} Mbit/s{where}")
    for col in ("algorithm", "k", "completion s", "schedule bound s", "measured/bound", "fabric bound s",
                "measured/fabric bound", "measured/(M/R)"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(r["algorithm"], str(r["k"]), f"{r['completion_s']:.3f}", f"{r['schedule_bound_s']:.3f}",
                      f"{r['ratio_to_schedule_bound']:.3f}", f"{r['fabric_bound_s']:.3f}",
                      f"{r['ratio_to_fabric_bound']:.3f}", f"{r['ratio_to_lower_bound']:.3f}")
    Console().print(table)
    for k, r in result.get("chain_vs_blind", {}).items():
        typer.echo(f"chain/chain-blind ({k}): {r['measured']:.3f} measured, "
                   f"{r['at_fabric_bounds']:.3f} at the fabric's bounds")


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
    from benchmarks.bench_engine import run_engine_benchmark

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


@bench_app.command("serve")
def serve(
    model: str = typer.Option("smollm2", "--model", help="smollm2 (the demo model), a random-weight preset "
                                                         "(tiny, small, 100m, ...) or a block checkpoint's path."),
    new_tokens: int = typer.Option(32, "--new-tokens", min=2, help="Tokens per stream."),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Trials; the median is reported, every trial listed."),
    torch_threads: int = typer.Option(1, "--torch-threads", min=1,
                                      help="The worker's and the engine baseline's (1, as `layercast up`: on a "
                                           "2-core machine 2 OpenMP threads contend with the serving path)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """Streams through the gateway (1, 4, 16 at once) against the engine's decode rate at that batch."""
    import torch

    from benchmarks.bench_serve import CONCURRENCY, run_serve_benchmark
    from benchmarks.harness import mode_cluster
    from libs.checkpoint.gguf import build_demo_model

    state_dir = state_dir.resolve()
    path = Path(model) if Path(model).is_dir() else build_demo_model(state_dir / "models", model, 4)
    torch.set_num_threads(torch_threads)
    with mode_cluster("layercast", workers=1, model_path=path, state_dir=state_dir / "bench-serve",
                      min_instances=1, keep_alive_s=3600, torch_threads=torch_threads,
                      slots_per_instance=max(CONCURRENCY), kv_cache_gb=2.0, settle=False) as handle:
        result = run_serve_benchmark(handle, path, new_tokens, repeat)
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console

    Console().print_json(json.dumps(result))


def _emulation_profile(emulate: bool, link_mbit: float | None, disk_mbit: float | None,
                       host_to_device_mbit: float | None, cpu_quota: float | None,
                       host_cache_models: int | None = None, leaves: int | None = None,
                       uplink_mbit: float | None = None, scaleup_group_size: int | None = None):
    """The default emulated cluster profile with the command's overrides (None: not emulated)."""
    from libs.cluster.emulation import can_emulate, requested_profile

    try:
        profile = requested_profile(emulate, link_mbit=link_mbit, disk_read_mbit=disk_mbit,
                                    host_to_device_mbit=host_to_device_mbit, cpu_quota=cpu_quota,
                                    host_cache_models=host_cache_models, leaves=leaves, uplink_mbit=uplink_mbit,
                                    scaleup_group_size=scaleup_group_size)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if profile is not None:
        ok, why = can_emulate()
        if not ok:
            raise typer.BadParameter(f"cannot emulate a cluster here: {why}")
    return profile


@bench_app.command("trace")
def trace(
    trace_csv: Path = typer.Argument(..., exists=True, dir_okay=False,
                                     help="A trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens (Azure LLM 2023)."),
    modes: str = typer.Option("layercast,serverlessllm,ideal", "--modes",
                              help="Scaling modes, each replayed on its own fresh cluster."),
    time_scale: float = typer.Option(10.0, "--time-scale", min=1e-3, help="Compress time: 10 replays 10 min in 1."),
    rate_scale: float = typer.Option(0.1, "--rate-scale", min=1e-6, max=1.0,
                                     help="Keep this seeded, deterministic fraction of the rows."),
    start_s: float = typer.Option(0.0, "--start-s", min=0, help="Skip the trace's first seconds."),
    duration_s: float = typer.Option(600.0, "--duration-s", min=0,
                                     help="Take this many seconds of the trace (0: all of it)."),
    max_prompt_tokens: int = typer.Option(256, "--max-prompt-tokens", min=1),
    max_output_tokens: int = typer.Option(32, "--max-output-tokens", min=1),
    prompt_scaling: str = typer.Option("scale", "--prompt-scaling",
                                       help="scale: x cap/observed max (keeps the shape) | clip: min(len, cap)."),
    output_scaling: str = typer.Option("clip", "--output-scaling", help="scale | clip (as --prompt-scaling)."),
    seed: int = typer.Option(0, "--seed", help="Thinning and prompt-token seed."),
    workers: int = typer.Option(2, "--workers", min=1, help="Workers per cluster."),
    max_instances: int = typer.Option(0, "--max-instances", min=0, help="Per deployment (0: --workers); "
                                      "static runs this many the whole time."),
    preset: str = typer.Option("tiny", "--preset", help="Demo model (built once, without an EOS token)."),
    blocks: int = typer.Option(2, "--blocks", min=1, help="Blocks of the demo model."),
    model: Path = typer.Option(None, "--model", help="A block checkpoint of your own instead of the demo model."),
    keep_alive_s: float = typer.Option(3.0, "--keep-alive-s", min=0, help="Idle time before scale-to-zero."),
    scale_down_delay_s: float = typer.Option(5.0, "--scale-down-delay-s", min=0,
                                             help="Load-monitor: time a scale-in must be wanted first (the "
                                                  "cluster's, for policies without a timeout of their own)."),
    policy: str = typer.Option("concurrency", "--policy", help="The deployments' scaling policy: threshold | "
                               "concurrency | slo."),
    policy_param: list[str] = typer.Option([], "--policy-param", metavar="KEY=VALUE",
                                           help="A parameter of the policy (repeatable), e.g. capacity_tps=200 "
                                                "or scale_down_delay_s=0.5 (the deployment's own delay)."),
    serverlessllm_keep_alive_s: float = typer.Option(
        None, "--serverlessllm-keep-alive-s", min=0,
        help="serverlessllm's host-cache keep-alive (default: λScale's 15 s of trace time, i.e. 15 / --time-scale)."),
    target_concurrency: int = typer.Option(2, "--target-concurrency", min=1,
                                           help="Load-monitor: requests in flight per instance."),
    slo_factor: float = typer.Option(5.0, "--slo-factor", min=1.0, help="SLO = factor x unloaded TTFT/TBT."),
    calibration_requests: int = typer.Option(5, "--calibration-requests", min=1),
    slo_ttft_s: float = typer.Option(None, "--slo-ttft-s", help="With --slo-tbt-s: fixed SLO, no calibration."),
    slo_tbt_s: float = typer.Option(None, "--slo-tbt-s"),
    request_timeout_s: float = typer.Option(120.0, "--request-timeout-s", min=1.0,
                                            help="A request slower than this counts as failed."),
    emulate: bool = typer.Option(False, "--emulate", help="Root: emulated cluster (default profile)."),
    link_mbit: float = typer.Option(None, "--link-mbit", help="With --emulate; 0: not capped."),
    disk_mbit: float = typer.Option(None, "--disk-mbit", help="With --emulate; 0: not capped."),
    host_to_device_mbit: float = typer.Option(None, "--host-to-device-mbit", help="With --emulate; 0: not capped."),
    cpu_quota: float = typer.Option(None, "--cpu-quota", help="With --emulate: CPUs per worker; 0: not capped."),
    host_cache_models: int = typer.Option(None, "--host-cache-models", min=0,
                                          help="With --emulate: models a worker's host memory keeps (default 3); "
                                               "0: bounded by bytes only."),
    leaves: int = _leaves_option(),
    uplink_mbit: float = _uplink_option(),
    scaleup_group_size: int = _scaleup_option(),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG: request rate, instances, TTFT CDF."),
    attribution: str = typer.Option(None, "--attribution", help="The trace's attribution (default: from its name)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """Replay a request trace against one fresh cluster per scaling mode: TTFT/TBT percentiles, SLO attainment
    (SLO = 5x unloaded, calibrated once), instance-seconds, scale operations.

    Defaults: the first 600 s of the trace, a seeded tenth of its rows, time / 10, prompts scaled
    to <= 256 tokens (x 256 / observed max), outputs clipped to <= 32, the tiny demo model, 2
    workers, keep-alive 3 s, scale-in once wanted for 5 s, 2 requests in flight per instance, serverlessllm's
    host cache kept 15 s of trace time (15 s / time scale, as the trace's gaps are scaled): 168 requests
    of the Azure code trace in 60 s per mode, three modes in about 4-5 minutes on a 2-core
    machine. Progress goes to stderr.
    """
    from benchmarks.trace_replay import Transform
    from benchmarks.bench_trace import TraceBenchConfig, parse_modes, run_trace_benchmark, to_jsonable

    try:
        mode_list = parse_modes(modes)
        tf = Transform(time_scale=time_scale, rate_scale=rate_scale, max_prompt_tokens=max_prompt_tokens,
                       max_output_tokens=max_output_tokens, prompt_scaling=prompt_scaling,
                       output_scaling=output_scaling, start_s=start_s, duration_s=duration_s or None, seed=seed)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if (slo_ttft_s is None) != (slo_tbt_s is None):
        raise typer.BadParameter("give both --slo-ttft-s and --slo-tbt-s, or neither")
    profile = _emulation_profile(emulate, link_mbit, disk_mbit, host_to_device_mbit, cpu_quota,
                                 host_cache_models, leaves, uplink_mbit, scaleup_group_size)
    params: dict[str, float] = {}
    for pair in policy_param:
        key, sep, value = pair.partition("=")
        try:
            params[key.strip()] = float(value) if sep and key.strip() else float("x")
        except ValueError:
            raise typer.BadParameter(f"--policy-param wants KEY=NUMBER, got {pair!r}") from None
    cfg = TraceBenchConfig(workers=workers, max_instances=max_instances or None, preset=preset, blocks=blocks,
                           model_path=model, keep_alive_s=keep_alive_s, scale_down_delay_s=scale_down_delay_s,
                           policy=policy, policy_params=params,
                           serverlessllm_keep_alive_s=serverlessllm_keep_alive_s,
                           target_concurrency=target_concurrency, slo_factor=slo_factor,
                           calibration_requests=calibration_requests, slo_ttft_s=slo_ttft_s, slo_tbt_s=slo_tbt_s,
                           request_timeout_s=request_timeout_s, emulate=emulate, profile=profile)
    from libs.cluster.launcher import ClusterError

    try:
        result = to_jsonable(run_trace_benchmark(trace_csv, mode_list, tf, cfg, state_dir, plot, attribution))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except (ClusterError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{trace_csv.name}: {result['transform']['requests']} requests, SLO TTFT "
                        f"{result['slo']['ttft_s']:.3g} s / TBT {result['slo']['tbt_s']:.3g} s")
    for col in ("mode", "TTFT p50/p90/p99 s", "TBT p50/p90/p99 s", "SLO", "instance-s", "scale ops", "failed"):
        table.add_column(col, justify="right")

    def triple(p: dict) -> str:
        return "/".join("-" if p[k] is None else f"{p[k]:.3g}" for k in ("p50", "p90", "p99"))

    for r in result["results"]:
        slo = "-" if r["slo_attainment"] is None else f"{r['slo_attainment']:.1%}"
        table.add_row(r["mode"], triple(r["ttft_s"]), triple(r["tbt_s"]), slo, f"{r['instance_seconds']:.1f}",
                      str(r["scale_ops"]), f"{r['failed']}/{r['requests']}")
    console = Console()
    console.print(table)
    console.print(f"trace: {result['attribution']}")
    if plot is not None:
        console.print(f"plot: {plot}")


@bench_app.command("scale")
def scale(
    workers: int = typer.Option(8, "--workers", min=2, help="Workers in the cluster."),
    from_n: int = typer.Option(1, "--from", min=1, help="Instances loaded before the burst."),
    to_n: int = typer.Option(8, "--to", min=2, help="Instances the burst asks for."),
    modes: str = typer.Option("layercast,serverlessllm,faasnet,binomial,chain,ideal", "--modes"),
    repeat: int = typer.Option(3, "--repeat", min=1, help="Trials per mode; the median is reported."),
    preset: str = typer.Option("100m", "--preset", help="Demo model (100m: ~200 MB in bf16)."),
    blocks: int = typer.Option(8, "--blocks", min=1, help="Blocks of the demo model."),
    model: Path = typer.Option(None, "--model", help="A block checkpoint of your own instead of the demo model."),
    concurrency: int = typer.Option(0, "--concurrency", min=0, help="Request streams during the burst (0: --to)."),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1),
    burst: int = typer.Option(0, "--burst", min=0,
                              help="FaaScale Fig. 9: N requests at once with the decision, instead of request "
                                   "streams; reports the burst's and new capacity's first-token times."),
    overload_rps: float = typer.Option(0.0, "--overload-rps", min=0,
                                       help="Instead of streams or --burst: requests at this fixed rate (above one "
                                            "instance's capacity) from --overload-lead-s before the decision until "
                                            "every target loaded; reports the window's latency p50/p90, the first "
                                            "throughput rise and the pair events."),
    overload_lead_s: float = typer.Option(3.0, "--overload-lead-s", min=1.0,
                                          help="Seconds the overload stream runs before the decision."),
    prompt_words: int = typer.Option(0, "--prompt-words", min=0,
                                     help="With --overload-rps: words added to each prompt (prefill-heavy requests)."),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG: the tokens/s timelines, one line per mode."),
    emulate: bool = typer.Option(True, "--emulate/--no-emulate", help="Root: the emulated cluster profile."),
    link_mbit: float = typer.Option(None, "--link-mbit", help="With --emulate; 0: not capped."),
    disk_mbit: float = typer.Option(None, "--disk-mbit", help="With --emulate; 0: not capped."),
    host_to_device_mbit: float = typer.Option(None, "--host-to-device-mbit", help="With --emulate; 0: not capped."),
    cpu_quota: float = typer.Option(None, "--cpu-quota", help="With --emulate: CPUs per worker; 0: not capped."),
    host_cache_models: int = typer.Option(None, "--host-cache-models", min=0,
                                          help="With --emulate: models a worker's host memory keeps (default 3); "
                                               "0: bounded by bytes only."),
    leaves: int = _leaves_option(),
    uplink_mbit: float = _uplink_option(),
    scaleup_group_size: int = _scaleup_option(),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="Per wait (settle, scale-out)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """One controlled burst per scaling mode: decision -> first byte, -> each instance loaded, -> all
    loaded, tokens/s every 100 ms, against each mode's physical bound under the emulated rates."""
    from benchmarks.bench_scale import run_scale_benchmark
    from benchmarks.bench_trace import bench_model, parse_modes
    from libs.cluster.launcher import ClusterError

    profile = _emulation_profile(emulate, link_mbit, disk_mbit, host_to_device_mbit, cpu_quota,
                                 host_cache_models, leaves, uplink_mbit, scaleup_group_size)
    try:
        path = model or bench_model(state_dir.resolve(), preset, blocks)
        result = run_scale_benchmark(modes=parse_modes(modes), workers=workers, from_n=from_n, to_n=to_n,
                                     model_path=path, state_dir=state_dir.resolve() / "bench-scale", emulate=emulate,
                                     profile=profile, repeat=repeat, concurrency=concurrency or None,
                                     max_tokens=max_tokens, timeout_s=timeout_s, burst=burst,
                                     overload_rps=overload_rps, overload_lead_s=overload_lead_s,
                                     prompt_words=prompt_words)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except (ClusterError, TimeoutError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if plot is not None:
        from benchmarks.bench_scale import TIMELINE_STEP_S, plot_timelines, timeline_marks

        plot.parent.mkdir(parents=True, exist_ok=True)
        plot_timelines(plot, {r["mode"]: r["tokens_per_s_timeline"] for r in result["results"]}, TIMELINE_STEP_S,
                       f"tokens/s after the scale decision ({result['from']} -> {result['to']}, burst {burst})",
                       marks={r["mode"]: timeline_marks(r.get("timings_s") or {}) for r in result["results"]})
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console

    Console().print_json(json.dumps(result))


@bench_app.command("mesh")
def mesh(
    models: str = typer.Option("4", "--models", help="K models (several demo checkpoints, seeds 0..K-1, tiny and "
                                                     "small alternating); a comma-separated list runs each K."),
    workers: int = typer.Option(2, "--workers", min=1, help="Worker processes (CPU quota and memory cap each)."),
    trials: int = typer.Option(1, "--trials", min=1, help="Trials per setting; the median trial is reported."),
    duration_s: float = typer.Option(30.0, "--duration-s", min=1.0, help="The trace is compressed to this."),
    load: float = typer.Option(1.0, "--load", min=0.01,
                               help="Offered load as a multiple of the capacity measured at the start of the run "
                                    "(what the workers complete per second at a full batch of the workload's mean "
                                    "request)."),
    rps: float = typer.Option(None, "--rps", min=0.01,
                              help="A fixed mean request rate instead of --load (its multiple of the capacity is "
                                   "reported)."),
    trace: str = typer.Option("code", "--trace", help="code | conv (the Azure LLM traces 2023) or a CSV path."),
    seed: int = typer.Option(0, "--seed", help="Thinning, Zipf mapping and prompt seed (same for both settings)."),
    zipf_s: float = typer.Option(1.0, "--zipf-s", min=0.0, help="Zipf exponent of the model popularity."),
    max_prompt_tokens: int = typer.Option(128, "--max-prompt-tokens", min=1),
    max_output_tokens: int = typer.Option(16, "--max-output-tokens", min=2),
    ttft_slo_s: float = typer.Option(None, "--ttft-slo-s", help="Per deployment (default: max(2, L/512) s)."),
    tpot_slo_s: float = typer.Option(0.25, "--tpot-slo-s", help="Per deployment (the paper's 0.25 s)."),
    keep_alive_s: float = typer.Option(10.0, "--keep-alive-s", min=0),
    cpu_quota: float = typer.Option(None, "--cpu-quota", min=0,
                                    help="CPUs per worker (cgroup v1 quota where permitted; default cpus / "
                                         "workers; 0: none)."),
    memory_gb: float = typer.Option(2.0, "--memory-gb", min=0,
                                    help="Per worker: cgroup memory cap where permitted, and the in-process "
                                         "engine/host capacities."),
    kv_cache_gb: float = typer.Option(0.25, "--kv-cache-gb", min=0.001, help="KV cache per instance."),
    request_timeout_s: float = typer.Option(60.0, "--request-timeout-s", min=1.0),
    settings: str = typer.Option("exclusive,mesh,dedicated", "--settings", help="Sharing settings to run."),
    plot: Path = typer.Option(None, "--plot", help="Write a PNG: SLO attainment against K (needs matplotlib)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir"),
) -> None:
    """K models on W workers, sharing=exclusive, sharing=mesh (LLM-Mesh) and sharing=dedicated (one model per
    worker at a time) on the same multi-model
    workload: the Azure LLM trace time-compressed to --duration-s, its requests mapped onto the K models by a
    seeded Zipf draw (no public multi-model LLM trace exists; LLM-Mesh maps models onto Azure Functions
    invocations). Reports SLO-compliant requests, TTFT/TPOT p50/p99, models served, instance-seconds,
    preemptions, KV resizes, reservation waits, OOMs and lost requests per setting. Progress goes to stderr."""
    from benchmarks.bench_mesh import MeshBenchConfig, plot_attainment, run_mesh_benchmark
    from libs.cluster.launcher import ClusterError

    ks = _int_list(models)
    if not ks or min(ks) < 1:
        raise typer.BadParameter("--models needs K >= 1")
    setting_list = tuple(s.strip() for s in settings.split(",") if s.strip())
    runs = []
    try:
        for k in ks:
            cfg = MeshBenchConfig(models=k, workers=workers, trials=trials, duration_s=duration_s, trace=trace,
                                  load=load, target_rps=rps, seed=seed, zipf_s=zipf_s,
                                  max_prompt_tokens=max_prompt_tokens,
                                  max_output_tokens=max_output_tokens, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                                  keep_alive_s=keep_alive_s, cpu_quota=cpu_quota, memory_gb=memory_gb,
                                  kv_cache_gb=kv_cache_gb, request_timeout_s=request_timeout_s,
                                  settings=setting_list)
            runs.append(run_mesh_benchmark(cfg, state_dir))
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None
    except (ClusterError, RuntimeError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    result = runs[0] if len(runs) == 1 else {"runs": runs}
    if plot is not None:
        try:
            offered = (f"{rps:g} req/s" if rps is not None
                       else f"{load:g}x capacity ({', '.join(str(r['offered_load']['rps']) for r in runs)} req/s)")
            plot_attainment(plot, runs, f"SLO attainment, {workers} workers, {duration_s:g} s at {offered}")
            result["plot"] = str(plot)
        except ImportError:
            typer.echo("matplotlib is not installed: no plot", err=True)
    if json_out:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for run in runs:
        table = Table(title=f"K={run['models']} models on {run['workers']} workers, "
                            f"{run['workload']['requests']} requests, median of {run['median_of']}; "
                            f"offered {run['offered_load']['multiple_of_capacity']}x capacity "
                            f"({run['offered_load']['rps']} req/s); mesh/exclusive SLO-compliant: {run['ratio']}, "
                            f"mesh/dedicated: {run['ratio_dedicated']}")
        for col in ("sharing", "SLO ok", "TTFT p50/p99 s", "TPOT p50/p99 s", "models", "instance-s", "lost",
                    "OOMs"):
            table.add_column(col, justify="right")
        for r in run["results"]:
            table.add_row(r["sharing"], f"{r['slo_compliant_requests']}/{r['requests']}",
                          f"{r['ttft_p50']}/{r['ttft_p99']}", f"{r['tpot_p50']}/{r['tpot_p99']}",
                          str(r["models_served"]), f"{r['instance_seconds']:.1f}", str(r["lost"]), str(r["ooms"]))
        console.print(table)
    console.print(f"trace: {runs[0]['attribution']}")
