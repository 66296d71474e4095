"""`layercast simulate-profile`: measure, on this machine, the profile the simulator needs to predict
a `layercast bench trace` setting, and write it as a profile file (libs/sim/profile.py's format).

What it measures and what it takes from the setting (each value's `cite` says which):

* compute: `layercast model profile`'s measurement (libs.engine.profiling, LLM-Mesh §5.2) of the
  benchmark's demo model (preset, blocks), one torch thread as the workers run, timed in the
  thread's CPU time (a loaded machine's other processes do not inflate it), divided by the
  workers' CPU quota (a CFS quota of q CPUs runs a one-thread engine at q of a core);
* building an engine for a new instance (KV slots for the worker's max batch and context):
  CPU time / quota; the engine's advertised batch is the profile's max_batch;
* the control plane: a NATS request/reply round trip on a local nats-server, halved per hop;
* links, disk reads, host->device: the emulated profile's caps (tc, blkio, paced copies), which
  the emulated cluster enforces (README, "Emulated cluster profile"); without emulation pass the
  rates measured by `layercast bench multicast` / `bench load`.

* serving overheads (`--serving-from`): what unloaded requests cost end to end beyond the compute
  profile (`request_overhead_s`, `token_overhead_s`; libs.sim.profile.serving_overheads), from the
  SLO calibration `layercast bench trace` makes on a warm instance before its replays. With
  `--base`, they are added to a profile measured before, which is not measured again.

The file also records `measured_for` (the setting) and the load average, so `simulate --validate`
can say when a profile was measured for another setting.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import typer

WORKER_MAX_BATCH = 16  # services/worker/service.py WorkerConfig.max_batch_size
WORKER_SEQ_LEN = 2048  # WorkerConfig.max_seq_len (the engine's KV slot length)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(1)


def _checkpoint(root: Path, preset: str, blocks: int) -> Path:
    """The benchmark's demo model's shapes (`bench_model` changes only lm_head's values)."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint, is_block_checkpoint

    hf, out = root / f"{preset}-hf", root / f"{preset}-{blocks}b"
    if not is_block_checkpoint(out):
        if not (hf / "config.json").exists():
            create_demo_checkpoint(hf, preset=preset, arch="llama", seed=0)
        convert_checkpoint(hf, out, blocks)
    return out


async def _nats_round_trips(url: str, n: int) -> list[float]:
    import nats

    nc = await nats.connect(url)
    try:
        async def echo(msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("simprofile.echo", cb=echo)
        await nc.flush()
        out = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            await nc.request("simprofile.echo", b"x" * 256, timeout=5)
            if i >= 5:  # the first few pay connection warm-up
                out.append(time.perf_counter() - t0)
        return out
    finally:
        await nc.close()


def measure_nats_hop(n: int = 200) -> float:
    """Half the median request/reply round trip through a local nats-server (started and stopped here)."""
    from libs.cluster.launcher import start_nats

    with tempfile.TemporaryDirectory(prefix="lc-simprofile-") as d:
        (Path(d) / "logs").mkdir()
        proc, url = start_nats(Path(d))
        try:
            rtts = asyncio.run(_nats_round_trips(url, n))
        finally:
            proc.kill()
            proc.wait(10)
    return statistics.median(rtts) / 2


def simulate_profile(
    out: Path = typer.Option(..., "--out", help="Write the profile file here."),
    preset: str = typer.Option("small-40k", "--preset", help="The benchmark's demo model (bench trace --preset)."),
    blocks: int = typer.Option(4, "--blocks", min=1, help="Its blocks (bench trace --blocks)."),
    cpu_quota: float = typer.Option(0.4, "--cpu-quota", min=0.0,
                                    help="CPUs per worker (bench trace --cpu-quota; 0: not capped)."),
    link_mbit: float = typer.Option(400.0, "--link-mbit", min=0.0, help="The emulated link (default profile)."),
    disk_mbit: float = typer.Option(40.0, "--disk-mbit", min=0.0, help="The emulated disk read rate."),
    host_to_device_mbit: float = typer.Option(500.0, "--host-to-device-mbit", min=0.0,
                                              help="The emulated host->device rate."),
    max_len: int = typer.Option(256, "--max-len", min=1, help="Longest prompt sampled (bench trace's "
                                "--max-prompt-tokens)."),
    max_batch: int = typer.Option(WORKER_MAX_BATCH, "--max-batch", min=1, help="Largest batch sampled."),
    kv_cache_gb: float = typer.Option(1.0, "--kv-cache-gb", min=0.001, help="The workers' KV budget per instance "
                                      "(worker --kv-cache-gb; bench scale runs 0.25): bounds the engine's batch."),
    repeats: int = typer.Option(3, "--repeats", min=1),
    name: str | None = typer.Option(None, "--name", help="The profile's name (default: measured-here; with --base, "
                                    "the base's)."),
    serving_from: list[Path] = typer.Option([], "--serving-from", help="A `bench trace --json` result (repeat): its "
                                            "SLO calibration gives the serving overheads (request_overhead_s, "
                                            "token_overhead_s)."),
    base: Path | None = typer.Option(None, "--base", help="With --serving-from: add the overheads to this profile "
                                     "file, measured before, instead of measuring one now."),
    state_dir: Path = typer.Option(Path(".layercast"), "--state-dir", help="Where the demo model is built (once)."),
) -> None:
    """Measure here the profile `layercast simulate --validate` needs for a bench trace setting."""
    if base is not None:
        if not serving_from:
            _fail("--base goes with --serving-from (it adds the serving overheads to a profile measured before)")
        try:
            data = json.loads(base.read_text())
        except (OSError, json.JSONDecodeError) as e:
            _fail(f"--base {base}: {e}")
        data["name"] = name or data.get("name", "measured-here")
        _write(out, _with_serving(data, serving_from))
        return
    name = name or "measured-here"
    import torch

    from libs.checkpoint import CheckpointIndex, load_block
    from libs.engine import Engine
    from libs.engine.profiling import measure_profile

    try:
        ckpt = _checkpoint(state_dir.resolve() / "sim-profile", preset, blocks)
    except (ValueError, OSError) as e:
        _fail(str(e))
    torch.set_num_threads(1)  # the workers' --torch-threads (launcher default 1)
    slow = 1.0 / cpu_quota if 0 < cpu_quota < 1 else 1.0
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    print(f"profiling {ckpt} (one torch thread, CPU time)", file=sys.stderr)
    prof = measure_profile(lambda b, s: Engine.from_checkpoint(ckpt, max_batch_size=b, max_seq_len=s,
                                                               kv_cache_bytes=1 << 40),
                           max_len, max_batch, repeats, clock=time.thread_time)
    index = CheckpointIndex.load(ckpt)
    held = {b.id: load_block(ckpt, index, b.id) for b in index.blocks}
    builds, engine = [], None
    for _ in range(3):
        c0 = time.thread_time()
        engine = Engine(index, held, max_batch_size=WORKER_MAX_BATCH, max_seq_len=WORKER_SEQ_LEN,
                        kv_cache_bytes=int(kv_cache_gb * (1 << 30)), tokenizer_dir=ckpt)
        builds.append(time.thread_time() - c0)
    advertised = engine.max_batch_size
    del engine, held
    print("timing NATS round trips", file=sys.stderr)
    hop = measure_nats_hop()
    model_bytes = sum(b.nbytes for b in index.blocks)
    load1 = os.getloadavg()
    quota_note = (f"CPU time of one torch thread x 1/{cpu_quota:g} (the workers' CPU quota)" if slow != 1
                  else "CPU time of one torch thread (no CPU quota)")
    here = f"measured here {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    emu = "the emulated profile's cap, enforced by the emulated cluster (README 'Emulated cluster profile')"
    data = {
        "name": name,
        "description": (f"This machine, for `layercast bench trace --preset {preset} --blocks {blocks}"
                        f"{f' --emulate --cpu-quota {cpu_quota:g}' if cpu_quota else ''}`: written by "
                        f"`layercast simulate-profile` ({here}; load average {load0[0]:.2f} before, "
                        f"{load1[0]:.2f} after; {time.perf_counter() - t0:.0f} s). Compute is CPU time, so "
                        "a busy machine does not inflate it; a worker that gets less than its quota runs slower "
                        "than this says."),
        "measured_for": {"preset": preset, "blocks": blocks, "cpu_quota": cpu_quota or None, "kv_cache_gb": kv_cache_gb,
                         "link_mbit": link_mbit or None, "disk_mbit": disk_mbit or None,
                         "h2d_mbit": host_to_device_mbit or None, "load_average": [round(load0[0], 2),
                                                                                  round(load1[0], 2)]},
        "values": {
            "link_gbps": {"value": (link_mbit or 100_000) / 1000, "cite": f"{link_mbit:g} Mbit/s: {emu}"},
            "disk_gbytes_per_s": {"value": (disk_mbit or 80_000) / 8000, "cite": f"{disk_mbit:g} Mbit/s: {emu}"},
            "h2d_gbytes_per_s": {"value": (host_to_device_mbit or 80_000) / 8000,
                                 "cite": f"{host_to_device_mbit:g} Mbit/s: {emu}"},
            "model_bytes": {"value": model_bytes, "cite": f"{here}: the {preset} demo checkpoint's blocks"},
            "n_blocks": {"value": len(index.blocks), "cite": f"--blocks {blocks}"},
            "max_batch": {"value": advertised, "cite": f"{here}: the engine's batch with the worker's defaults "
                          f"(max_batch_size {WORKER_MAX_BATCH}, max_seq_len {WORKER_SEQ_LEN}, KV {kv_cache_gb:g} GiB)"},
            "engine_build_s": {"value": round(statistics.median(builds) * slow, 5),
                               "cite": f"{here}: building the engine (KV slots, skeleton), median of 3, {quota_note}"},
            "nats_hop_s": {"value": round(hop, 6), "cite": f"{here}: half the median of 200 request/reply round "
                           "trips on a local nats-server"},
            "step_overhead_s": {"value": 0.003, "cite": "README: bench multicast measured binomial at 1.008x its "
                                "bound over 18 steps of 0.34 s (~3 ms a step)"},
            "registry_read_s": {"value": 0.005, "cite": "the planner's cached view (services/planner/views.py); "
                                "5 ms assumed, not measured"},
        },
        "compute": {
            "prefill_lengths": list(prof.prefill_lengths),
            "prefill_s": [round(x * slow, 6) for x in prof.prefill_s],
            "batches": list(prof.batches), "lengths": list(prof.lengths),
            "decode_s": [[round(x * slow, 6) for x in row] for row in prof.decode_s],
            "cite": f"{here}: libs.engine.profiling.measure_profile (LLM-Mesh §5.2), {preset} with {blocks} blocks, "
                    f"CPU, repeats {repeats}; {quota_note}",
        },
    }
    _write(out, _with_serving(data, serving_from) if serving_from else data)


def _write(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["values"] | {"compute_prefill_s": data["compute"]["prefill_s"]}, indent=1))


def _with_serving(data: dict, bench_files: list[Path]) -> dict:
    """`data` (a profile) with request_overhead_s and token_overhead_s from the SLO calibrations
    of these `bench trace --json` results, each value citing them."""
    from libs.sim.profile import ProfileError, profile_from_dict, serving_overheads

    cals = []
    for f in bench_files:
        try:
            slo = json.loads(f.read_text()).get("slo") or {}
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            _fail(f"--serving-from {f}: not a `bench trace --json` result ({e})")
        if not slo.get("calibrated"):
            _fail(f"--serving-from {f}: its SLO was given, not calibrated: no unloaded measurement in it")
        cals.append(slo)
    try:
        values = serving_overheads(profile_from_dict(data).compute, cals)
    except ProfileError as e:
        _fail(str(e))
    where = ", ".join(f.name for f in bench_files)
    how = ("median over the calibrations of `bench trace`'s SLO calibration (one warm instance, one request at a "
           f"time, before the replays) in {where}")
    data = {**data, "values": {**data["values"],
            "request_overhead_s": {"value": values["request_overhead_s"], "cite": (
                f"unloaded TTFT - the compute profile's prefill of the prompt, {how}")},
            "token_overhead_s": {"value": values["token_overhead_s"], "cite": (
                f"unloaded time between tokens - the compute profile's one-row decode iteration, {how}")}}}
    data["description"] = (data.get("description", "") + " Serving overheads from the SLO calibrations of "
                           f"{where} (`layercast simulate-profile --serving-from`).").strip()
    return data
