"""`layercast bench load`: the block loader against the raw disk, safetensors, torch.load and from_pretrained.

Every cold trial first drops the files' pages from the page cache (posix_fadvise DONTNEED).
Trials of the different methods are interleaved so that the shared disk's noise hits
them alike, and each figure is the best of its trials (bandwidths: highest, times:
lowest), the same statistic for the bound, the baselines and layercast.

layercast loads into a host arena reserved beforehand, as a worker started with
--host-arena-gb does; `layercast_cold_fresh_memory_gbps` is the same load into memory
allocated per load (a worker without an arena), for comparison. The raw bound
and the layercast cold load get three trials per repeat each (one per raw strategy,
alternating); the other methods one per repeat.

Loader peers (the `bench-peers` extra): runai-model-streamer and fastsafetensors (CPU mode,
`nogds=True, device="cpu"`) read the same safetensors file in the same run, each with its
library defaults (its documented settings: RUNAI_STREAMER_CONCURRENCY unset, which in 0.17
is an io_uring queue 64 reads of 8 MiB deep; fastsafetensors `max_threads=16`, 16 MiB bounce buffers) and with 1, 2 and 4 threads, cold and
warm, and each builds the model (ready: logits of the first token). layercast's own loader runs
the same 1/2/4 thread sweep. A peer that is not installed is listed under `peers` with the
reason it was skipped. Peer figures are the median of the repeats (and the best beside it).
Peak RSS is the process's high-water mark during a cold load above its resident size before it
(VmHWM, reset through /proc/self/clear_refs), in MB.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from libs.checkpoint import CheckpointIndex
from libs.checkpoint.format import torch_dtype
from libs.checkpoint.hostmem import HostArena
from libs.checkpoint.fastload import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_THREADS,
    BlockLoader,
    LoaderConfig,
    copy_to_device,
    drop_page_cache,
    open_for_read,
)

# Raw-disk strategies tried for the bound: (threads, read size). The bound is the best of them.
RAW_STRATEGIES = ((1, 64 << 20), (4, 16 << 20), (8, 4 << 20))
PROMPT_IDS = list(range(10, 26))  # the same 16-token prompt for every "ready" path


def raw_direct_read_gbps(path: Path, threads: int, read_bytes: int) -> float:
    """Read the whole file front to back with O_DIRECT into reused buffers: no checksum, no placement.

    The buffers come from a populated mmap region (a HostArena): reads into fresh malloc'd
    memory pay a page fault per page and would understate the bound.
    """
    size = path.stat().st_size
    fd, direct = open_for_read(path, True)
    next_offset = [0]
    lock = threading.Lock()
    arena = HostArena(threads * read_bytes)

    def run() -> None:
        buf = memoryview(arena.take(read_bytes).numpy())
        while True:
            with lock:
                offset = next_offset[0]
                next_offset[0] += read_bytes
            if offset >= size:
                return
            os.preadv(fd, [buf], offset)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    os.close(fd)
    if not direct:
        raise RuntimeError(f"{path}: the filesystem refuses O_DIRECT; the raw bound cannot be measured here")
    return size / seconds / 1e9


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _first_token_from_blocks(ckpt: Path, loader: BlockLoader) -> int:
    """The worker's own path: index, pipelined block load, an Engine over the arriving blocks
    (built while they load), prefill running each block as soon as it is verified."""
    from libs.engine import Engine, SamplingSpec

    index = CheckpointIndex.load(ckpt)
    job = loader.start(ckpt, index)
    engine = Engine(index, job, device=loader.device, max_batch_size=1)
    engine.add_request("bench", PROMPT_IDS, SamplingSpec(temperature=0, max_tokens=1))
    (out,) = engine.step()
    job.result()
    return out.token_id


def _first_logits_from_pretrained(hf: Path, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """from_pretrained onto the loader's device (on CUDA: device_map, weights straight to the GPU)."""
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    placement = {} if torch.device(device).type == "cpu" else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype, attn_implementation="sdpa", **placement).eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT_IDS], device=device), logits_to_keep=1).logits[0, -1].float().cpu()


def _first_logits_from_safetensors(hf: Path, weights: list[Path], dtype: torch.dtype,
                                   device: str = "cpu", load_state=None) -> torch.Tensor:
    """The model built on the meta device, its tensors assigned from a state dict read by
    `load_state(weights)` (default: safetensors' load_file), then a prefill's logits."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    state: dict[str, torch.Tensor] = {}
    if load_state is None:
        for w in weights:
            state.update(load_file(w, device=str(device)))
    else:
        state = {k: v.to(device) for k, v in load_state(weights).items()}
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    # Non-persistent rotary frequencies are not in the file: build them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"state dict left tensors on the meta device: {left[:3]}")
    with torch.inference_mode():
        return model.eval()(torch.tensor([PROMPT_IDS], device=device), logits_to_keep=1).logits[0, -1].float().cpu()


# ---------------------------------------------------------------------------------------------
# Loader peers: what a user would pick instead of layercast's loader (the `bench-peers` extra).

PEER_THREADS = (1, 2, 4)
PEERS_EXTRA = "pip install 'layercast[bench-peers]'"
# name -> (module to import, distribution name, the library's documented default thread count)
PEERS = {
    # unset, 0.17 reads with io_uring at a depth of 64 x 8 MiB here (its INFO log); the variable sets the depth
    "runai_model_streamer": ("runai_model_streamer", "runai-model-streamer", "library default"),
    "fastsafetensors": ("fastsafetensors", "fastsafetensors", 16),
}


def _import_peer(name: str) -> None:
    # written out, not importlib: the import graph (tests/unit/test_import_graph.py) sees them
    if name == "runai_model_streamer":
        import runai_model_streamer  # noqa: F401
    elif name == "fastsafetensors":
        import fastsafetensors  # noqa: F401
    else:  # a peer the benchmark has no code for: as good as not installed
        raise ModuleNotFoundError(f"No module named {PEERS[name][0]!r}")


def peer_status(name: str) -> str | None:
    """None if the peer can run here, else why it is skipped."""
    try:
        _import_peer(name)
    except ImportError as e:
        return f"not installed ({PEERS_EXTRA}): {e}"
    except Exception as e:  # a broken install (e.g. a native library that does not load)
        return f"failed to import: {type(e).__name__}: {e}"
    return None


def _load_runai(weights: list[Path], threads: int | None) -> dict[str, torch.Tensor]:
    """runai-model-streamer's SafetensorsStreamer onto the CPU; threads: RUNAI_STREAMER_CONCURRENCY
    (None: unset, the library's default), read by the C++ streamer when it starts."""
    from runai_model_streamer import SafetensorsStreamer

    saved = os.environ.get("RUNAI_STREAMER_CONCURRENCY")
    if threads is None:
        os.environ.pop("RUNAI_STREAMER_CONCURRENCY", None)
    else:
        os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(threads)
    try:
        state: dict[str, torch.Tensor] = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([str(w) for w in weights], device="cpu")
            for name, tensor in streamer.get_tensors():
                state[name] = tensor
        return state
    finally:
        if saved is None:
            os.environ.pop("RUNAI_STREAMER_CONCURRENCY", None)
        else:
            os.environ["RUNAI_STREAMER_CONCURRENCY"] = saved


def _load_fastsafetensors(weights: list[Path], threads: int | None) -> dict[str, torch.Tensor]:
    """fastsafetensors without GPUDirect Storage (`nogds=True`, device "cpu"); threads: max_threads
    (None: the library's default). The tensors own their buffer (the library's default mode)."""
    from fastsafetensors import SafeTensorsFileLoader

    kwargs = {} if threads is None else {"max_threads": threads}
    loader = SafeTensorsFileLoader(None, "cpu", nogds=True, **kwargs)
    try:
        loader.add_filenames({0: [str(w) for w in weights]})
        files = loader.copy_files_to_device()
        try:
            return {name: files.get_tensor(name) for name in loader.get_keys()}
        finally:
            files.close()
    finally:
        loader.close()


PEER_LOADERS = {"runai_model_streamer": _load_runai, "fastsafetensors": _load_fastsafetensors}


def _reset_peak_rss() -> int | None:
    """Reset the process's RSS high-water mark; return the resident bytes now (None: not on Linux).

    Memory freed by earlier loads is first handed back to the kernel (glibc's malloc_trim): left
    resident in the allocator, a load that reuses it would not raise the mark."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _measure(fn, *args):
    """(seconds, peak RSS above the resident size before, in MB or None, result)."""
    before = _reset_peak_rss()
    t0 = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - t0
    peak = None if before is None else max(0, _proc_status_bytes("VmHWM") - before) / 1e6
    return seconds, peak, result


def _measured_load(loader, ckpt: Path, index):
    """Start a load and wait for it: (the job, its peak RSS as _measure gives it, its result).
    The RSS mark is reset before the load starts: the reset's gc and malloc_trim inside the
    load's time counted against its GB/s (layercast's cold figure read 1.19 GB/s where the same
    loader started after them read 2.70)."""
    started = []

    def load():
        started.append(loader.start(ckpt, index))
        return started[0].result()
    _, peak, result = _measure(load)
    return started[0], peak, result


def _setting_label(threads: int | None) -> str:
    return "default" if threads is None else f"threads_{threads}"


def measure_peer(name: str, threads: int | None, hf: Path, weights: list[Path], dtype: torch.dtype,
                 device: str = "cpu") -> tuple[dict[str, float], torch.Tensor]:
    """One trial of a peer at one setting: a cold read (page cache dropped first) with its peak RSS,
    a warm read, and ready (cold again: the model built from what it read, its first logits).
    Returns the figures and those logits."""
    load = PEER_LOADERS[name]
    nbytes = sum(w.stat().st_size for w in weights)
    figures: dict[str, float] = {}
    for w in weights:
        drop_page_cache(w)
    seconds, peak, state = _measure(load, weights, threads)
    figures["cold_gbps"] = nbytes / seconds / 1e9
    if peak is not None:
        figures["peak_rss_mb"] = peak
    del state
    for w in weights:
        _warm(w)
    seconds, _, state = _measure(load, weights, threads)
    figures["warm_gbps"] = nbytes / seconds / 1e9
    del state
    for w in weights:
        drop_page_cache(w)
    seconds, logits = _timed(_first_logits_from_safetensors, hf, weights, dtype, device,
                             lambda ws: load(ws, threads))
    figures["ready_s"] = seconds
    return figures, logits


def _timed(fn, *args):
    t0 = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - t0, result


@dataclass
class _Trials:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def best(self, name: str, higher_is_better: bool) -> float:
        v = self.values[name]
        return max(v) if higher_is_better else min(v)


def run_load_benchmark(ckpt: Path, hf: Path, repeat: int = 3, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       threads: int = DEFAULT_THREADS, device: str = "cpu", peers: bool = True) -> dict:
    index = CheckpointIndex.load(ckpt)
    data = ckpt / index.data_file
    weights = sorted(hf.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors in {hf}")
    dtype = torch_dtype(next(t.dtype for t in index.tensors if ".layers." in t.name))
    model_bytes = index.total_nbytes
    config = LoaderConfig(chunk_bytes=chunk_bytes, threads=threads)
    # A worker started with --host-arena-gb: its host memory is reserved and faulted in at start
    # (not timed, as it is not part of a load). Room for three copies: a trial's buffers, the
    # previous trial's until they are dropped, and the host-tier copy.
    arena_bytes = 3 * index.total_nbytes + index.n_blocks * 4096
    arena = HostArena(arena_bytes, pin=torch.device(device).type == "cuda")
    loader = BlockLoader(device, config, arena=arena)
    fresh_loader = BlockLoader(device, config)  # a worker without an arena: new memory per load
    first_block = 0  # blocks load in model order
    first_block_bytes = index.block(first_block).nbytes

    scratch = Path(tempfile.mkdtemp(prefix=".bench-load-", dir=hf.parent))
    try:
        from safetensors.torch import load_file

        pt_file = scratch / "state_dict.pt"
        state = {}
        for w in weights:
            state.update(load_file(w))
        torch.save(state, pt_file)
        del state
        safetensors_bytes = sum(w.stat().st_size for w in weights)
        pt_bytes = pt_file.stat().st_size

        # One untimed pass of each ready path: lazy imports and one-time initialisation are the
        # process's start-up, not a load, and are excluded for all three alike.
        _first_token_from_blocks(ckpt, loader)
        _first_logits_from_pretrained(hf, dtype, device)
        _first_logits_from_safetensors(hf, weights, dtype, device)
        skipped = {name: peer_status(name) for name in PEERS} if peers else {
            name: "not run (--no-peers)" for name in PEERS}
        for name in PEERS:
            if skipped[name] is None:  # the peer's one-time start-up, untimed as above
                try:
                    _first_logits_from_safetensors(hf, weights, dtype, device,
                                                   lambda ws, n=name: PEER_LOADERS[n](ws, None))
                except Exception as e:  # a peer that fails here is reported, never fatal
                    skipped[name] = f"failed: {type(e).__name__}: {e}"
        running = [name for name in PEERS if skipped[name] is None]

        trials = _Trials()
        logits: dict[str, torch.Tensor] = {}
        cold_vs_raw: list[float] = []
        outside_arena = 0
        for _ in range(repeat):
            # The disk's speed drifts (a shared virtual disk): each raw strategy is followed by a
            # layercast cold load, and the ratio is taken inside the repeat, same number of samples.
            raw, cold = [], []
            for n_threads, read_bytes in RAW_STRATEGIES:
                drop_page_cache(data)
                raw.append(raw_direct_read_gbps(data, n_threads, read_bytes))
                drop_page_cache(data)
                job, peak, host_blocks = _measured_load(loader, ckpt, index)
                if peak is not None:
                    trials.add("layercast_peak_rss_mb", peak)
                cold.append(job.stats.gbps)
                outside_arena = max(outside_arena, job.stats.outside_arena_bytes)
                trials.add("first_block_ms", job.stats.block_ready_s[first_block] * 1e3)
            for r, c in zip(raw, cold):
                trials.add("raw_gbps", r)
                trials.add("layercast_cold_gbps", c)
            cold_vs_raw.append(max(cold) / max(raw))

            drop_page_cache(data)
            job, peak, _ = _measured_load(fresh_loader, ckpt, index)
            trials.add("layercast_cold_fresh_memory_gbps", job.stats.gbps)
            if peak is not None:
                trials.add("layercast_cold_fresh_memory_peak_rss_mb", peak)
            del job

            _warm(data)
            job = loader.start(ckpt, index)
            job.result()
            trials.add("layercast_warm_gbps", job.stats.gbps)

            # Host tier -> engine-ready: the host copies of the blocks (page-locked with CUDA) to
            # fresh buffers on the device; on the CPU that is a copy into new host memory.
            host_copies = {b: buf[: index.block(b).nbytes] for b, buf in job.host.items()} or host_blocks
            seconds, _ = _timed(copy_to_device, host_copies, device, chunk_bytes)
            trials.add("host_tier_gbps", model_bytes / seconds / 1e9)
            del host_blocks, host_copies, job

            for w in weights:
                drop_page_cache(w)
            seconds, peak, _ = _measure(lambda: [load_file(w) for w in weights])
            trials.add("safetensors_cold_gbps", safetensors_bytes / seconds / 1e9)
            if peak is not None:
                trials.add("safetensors_peak_rss_mb", peak)

            # layercast's loader with the peers' thread counts (into the arena, as above).
            for n in PEER_THREADS:
                drop_page_cache(data)
                job = BlockLoader(device, LoaderConfig(chunk_bytes=chunk_bytes, threads=n), arena=arena).start(
                    ckpt, index)
                job.result()
                trials.add(f"layercast[threads_{n}]_cold_gbps", job.stats.gbps)
                del job

            # The peers: library defaults, then 1, 2, 4 threads; cold, warm, then ready (the model
            # built from what they read, its first logits).
            for name in list(running):
                try:
                    for n in (None, *PEER_THREADS):
                        key = f"{name}[{_setting_label(n)}]"
                        figures, logits[key] = measure_peer(name, n, hf, weights, dtype, device)
                        for metric, value in figures.items():
                            trials.add(f"{key}_{metric}", value)
                except Exception as e:  # reported under `peers`, the run goes on without it
                    skipped[name] = f"failed: {type(e).__name__}: {e}"
                    running.remove(name)

            drop_page_cache(pt_file)
            seconds, _ = _timed(torch.load, pt_file, "cpu")
            trials.add("torch_load_cold_gbps", pt_bytes / seconds / 1e9)

            drop_page_cache(data)
            seconds, first_token = _timed(_first_token_from_blocks, ckpt, loader)
            trials.add("layercast_ready_s", seconds)
            for w in weights:
                drop_page_cache(w)
            seconds, logits["from_pretrained"] = _timed(_first_logits_from_pretrained, hf, dtype, device)
            trials.add("from_pretrained_ready_s", seconds)
            for w in weights:
                drop_page_cache(w)
            seconds, logits["safetensors"] = _timed(_first_logits_from_safetensors, hf, weights, dtype, device)
            trials.add("safetensors_ready_s", seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    higher = {"raw_gbps", "layercast_cold_gbps", "layercast_cold_fresh_memory_gbps", "layercast_warm_gbps",
              "host_tier_gbps",
              "safetensors_cold_gbps", "torch_load_cold_gbps"}
    flat = [n for n in trials.values if "[" not in n]  # the per-setting figures go under `peers`
    result: dict = {name: round(trials.best(name, name in higher or name.endswith("_gbps")), 4) for name in flat}
    # The three ready paths must compute the same thing, or the comparison means nothing.
    reference = logits["from_pretrained"]
    max_diff = float((logits["safetensors"] - reference).abs().max())
    same_top = len({int(v.argmax()) for v in logits.values()} | {first_token}) == 1
    peers_out = _peers_section(trials, skipped, running, logits, reference)
    med = {k: statistics.median(v) for k, v in trials.values.items()}
    first_block_bound_ms = 2 * first_block_bytes / (result["raw_gbps"] * 1e9) * 1e3 + 20
    result.update(
        model_bytes=model_bytes,
        chunk_bytes=chunk_bytes,
        threads=threads,
        device=device,
        repeat=repeat,
        first_block_bytes=first_block_bytes,
        arena_bytes=arena_bytes,
        outside_arena_bytes=outside_arena,  # loads that did not fit the arena (0: every trial used it)
        ratios={
            "layercast_cold_vs_raw": round(result["layercast_cold_gbps"] / result["raw_gbps"], 3),
            "layercast_cold_vs_raw_per_repeat": [round(x, 3) for x in cold_vs_raw],
            "layercast_cold_fresh_memory_vs_raw": round(
                result["layercast_cold_fresh_memory_gbps"] / result["raw_gbps"], 3),
            "from_pretrained_vs_layercast_ready": round(
                result["from_pretrained_ready_s"] / result["layercast_ready_s"], 3),
            "safetensors_ready_vs_layercast_ready": round(
                result["safetensors_ready_s"] / result["layercast_ready_s"], 3),
            "layercast_cold_vs_safetensors_cold": round(
                result["layercast_cold_gbps"] / result["safetensors_cold_gbps"], 3),
            "first_block_ms_vs_bound": round(result["first_block_ms"] / first_block_bound_ms, 3),
        },
        first_block_bound_ms=round(first_block_bound_ms, 2),
        logits_max_abs_diff=max_diff,
        same_first_token=same_top,
        peers=peers_out,
        comparison=_comparison(med, result, peers_out),
        trials={k: [round(x, 4) for x in v] for k, v in trials.values.items()},
        median={k: round(statistics.median(v), 4) for k, v in trials.values.items()},
    )
    return result


def _peers_section(trials: _Trials, skipped: dict, running: list[str], logits: dict,
                   reference: torch.Tensor) -> dict:
    """Per peer: its version and, for each setting, the median (and best) of its trials; or why it
    was skipped. Also layercast's own thread sweep, under `layercast`."""
    def stats(key: str) -> dict:
        out = {}
        for metric, higher in (("cold_gbps", True), ("warm_gbps", True), ("ready_s", False), ("peak_rss_mb", False)):
            v = trials.values.get(f"{key}_{metric}")
            if v:
                out[metric] = round(statistics.median(v), 4)
                out[metric + "_best"] = round(max(v) if higher else min(v), 4)
        return out

    section: dict = {}
    for name, (_, dist, default_threads) in PEERS.items():
        if name not in running:
            section[name] = {"skipped": skipped[name]}
            continue
        settings = {}
        for n in (None, *PEER_THREADS):
            key = f"{name}[{_setting_label(n)}]"
            settings[_setting_label(n)] = {"threads": n or default_threads, **stats(key),
                                           "logits_max_abs_diff": float((logits[key] - reference).abs().max()),
                                           "same_first_token": int(logits[key].argmax()) == int(reference.argmax())}
        best = max(settings, key=lambda s: settings[s]["cold_gbps"])
        section[name] = {"version": importlib.metadata.version(dist), "best_setting": best, "settings": settings}
    section["layercast"] = {f"threads_{n}": stats(f"layercast[threads_{n}]") for n in PEER_THREADS}
    return section


def _comparison(med: dict, result: dict, peers_out: dict) -> dict:
    """Medians side by side: raw O_DIRECT reads (the bound: its best), layercast, safetensors and each
    peer at its best setting (highest median cold GB/s); layercast / peer ratios (above 1: layercast
    ahead, for GB/s; for ready time, peer / layercast above 1: layercast ahead)."""
    def pick(prefix: str, names=("cold_gbps", "warm_gbps", "ready_s", "peak_rss_mb")) -> dict:
        return {n: round(med[f"{prefix}_{n}"], 4) for n in names if f"{prefix}_{n}" in med}

    rows = {
        "raw_o_direct": {"cold_gbps": result["raw_gbps"], "cold_gbps_median": round(med["raw_gbps"], 4)},
        # a worker with --host-arena-gb: its memory reserved before the load (arena_bytes)
        "layercast": pick("layercast"),
        # a worker without one: each load allocates (and faults in) its memory, as the peers do
        "layercast_without_arena": {"cold_gbps": round(med["layercast_cold_fresh_memory_gbps"], 4),
                                    **pick("layercast_cold_fresh_memory", ("peak_rss_mb",))},
        "safetensors": pick("safetensors"),
    }
    ratios = {}
    for name, peer in peers_out.items():
        if name == "layercast" or "skipped" in peer:
            continue
        best = peer["settings"][peer["best_setting"]]
        rows[name] = {"setting": peer["best_setting"], **{k: best[k] for k in (
            "cold_gbps", "warm_gbps", "ready_s", "peak_rss_mb") if k in best}}
        ratios[name] = {
            "layercast_cold_gbps_vs_peer": round(rows["layercast"]["cold_gbps"] / best["cold_gbps"], 3),
            "layercast_without_arena_cold_gbps_vs_peer": round(
                rows["layercast_without_arena"]["cold_gbps"] / best["cold_gbps"], 3),
            "peer_ready_s_vs_layercast": round(best["ready_s"] / rows["layercast"]["ready_s"], 3),
            "layercast_warm_gbps_vs_peer": round(rows["layercast"]["warm_gbps"] / best["warm_gbps"], 3),
        }
    return {"statistic": "median of the repeats", "loaders": rows, "layercast_vs_peers": ratios}


def sweep(ckpt: Path, repeat: int, chunks=(4 << 20, 16 << 20, 64 << 20), thread_counts=(1, 2, 4, 8)) -> dict:
    """Cold load bandwidth for each (chunk size, thread count), best of `repeat`: how the defaults were chosen."""
    index = CheckpointIndex.load(ckpt)
    data = ckpt / index.data_file
    arena = HostArena(2 * index.total_nbytes + index.n_blocks * 4096)  # as in the main trials
    out: dict[str, float] = {}
    for _ in range(repeat):
        for chunk in chunks:
            for n in thread_counts:
                drop_page_cache(data)
                job = BlockLoader("cpu", LoaderConfig(chunk_bytes=chunk, threads=n), arena=arena).start(ckpt, index)
                job.result()
                key = f"{chunk >> 20}MiBx{n}"
                out[key] = max(out.get(key, 0.0), round(job.stats.gbps, 3))
    return out


def demo_paths(state_dir: Path) -> tuple[Path, Path]:
    """The 200m demo model (about 440 MB, bf16) for benchmarks, created once under the state dir."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint, is_block_checkpoint

    root = state_dir / "bench" / "llama-200m"
    hf, blocks = root / "hf", root / "blocks"
    if not (hf / "config.json").is_file():
        create_demo_checkpoint(hf, preset="200m", arch="llama")
    if not is_block_checkpoint(blocks):
        convert_checkpoint(hf, blocks, 8)
    return blocks, hf
