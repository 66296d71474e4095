"""`layercast bench trace`: replay a real request trace against one fresh cluster per
scaling mode and compare TTFT, TBT, SLO attainment, instance-seconds and scale operations.

1. The trace is transformed once (benchmarks/trace_replay.py: window, token fitting,
   seeded thinning, time compression); every mode replays the same requests.
2. The SLO is calibrated once, before the replays, as in BlitzScale §6.2: on a warm
   instance (a `static` cluster with one instance), one request at a time, with the
   median prompt and output length of the replay; SLO = factor (5) x the unloaded TTFT and
   mean TBT. The same SLO applies to every mode.
3. Per mode (benchmarks/harness.py): a fresh cluster, the model deployed with that
   `scaling_mode`, then every request is sent at its trace time (no concurrency bound),
   streaming, through the gateway's `/v1/completions` with its prompt as token ids of the
   transformed length and `max_tokens` = the transformed output length. A request that
   fails, is refused or times out counts in `failed`; none is dropped.

Requests run to max_tokens and stream one chunk per token: the gateway has no `ignore_eos`
and streams a chunk only when new text appears, so the benchmark's own demo model has no
end-of-sequence token and only ever picks tokens with visible text (`make_bench_model`).
With a model of your own (--model) an early stop is possible and is counted in
`early_stops`, and tokens without a chunk of their own in `tokens_without_chunk` (TTFT and
TBT are measured on chunks).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import statistics
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

import httpx

from libs.planning.scaleout import SERVERLESSLLM_KEEP_ALIVE_S
from benchmarks.trace_replay import (
    ReplayRequest,
    Transform,
    apply_transform,
    instance_seconds,
    instance_steps,
    parse_trace,
    percentiles,
    rate_series,
    scale_out_summary,
    scale_out_times,
    slo_attainment,
    transform_summary,
)
from benchmarks.harness import ClusterHandle, mode_cluster

AZURE_ATTRIBUTION = ("Azure LLM inference traces 2023 (Azure/AzurePublicDataset, AzureLLMInferenceTrace_{kind}.csv, "
                     "collected from Azure OpenAI GPT services on 2023-11-16), CC-BY-4.0")
SPECIAL_IDS = 5  # the demo tokenizer's special tokens are ids 0..4: prompts avoid them


def attribution_for(trace: Path) -> str:
    name = trace.name.lower()
    if "azure" in name:
        kind = "code" if "code" in name else "conv" if "conv" in name else "*"
        return AZURE_ATTRIBUTION.format(kind=kind)
    return f"trace {trace.name}"


_T0 = time.monotonic()


def _log(msg: str) -> None:
    print(f"[bench trace +{time.monotonic() - _T0:.1f}s] {msg}", file=sys.stderr, flush=True)


# --- the model ---------------------------------------------------------------------------------


BENCH_MODEL_MARKER = "layercast_bench_model.json"


def bench_model(state_dir: Path, preset: str = "tiny", blocks: int = 2) -> Path:
    """The benchmark's demo checkpoint (built once): every request runs to max_tokens with one
    streamed chunk per token (see `make_bench_model`)."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint, is_block_checkpoint

    root = state_dir.resolve() / "models"
    hf, out = root / f"bench-{preset}-hf", root / f"bench-{preset}-{blocks}b"
    if is_block_checkpoint(out) and (out / BENCH_MODEL_MARKER).exists():
        return out
    if not (hf / BENCH_MODEL_MARKER).exists():
        shutil.rmtree(hf, ignore_errors=True)
        create_demo_checkpoint(hf, preset=preset, arch="llama", seed=0)
        make_bench_model(hf)
    shutil.rmtree(out, ignore_errors=True)
    convert_checkpoint(hf, out, blocks)
    shutil.copy(hf / BENCH_MODEL_MARKER, out / BENCH_MODEL_MARKER)
    os.sync()  # the writeback of what was just written would otherwise slow the first trial's disk
    return out


def make_bench_model(hf: Path) -> dict:
    """Make a random-weight HF checkpoint behave like a benchmark client wants (in place):

    - no end-of-sequence token (config and generation config): the gateway has no
      `ignore_eos`, so this is what makes every request run to max_tokens;
    - greedy decoding only ever picks a token that decodes, on its own, to non-empty ASCII
      text: the gateway streams a chunk only when new text appears, so a token without text
      (a special token, a lone byte of a multi-byte character, an id past the tokenizer)
      would hide its own arrival time and skew TTFT and TBT. Each other token's lm_head row
      becomes half of a visible token's row: its logit is half that token's, so whenever
      the largest visible logit is positive (always, in practice, with hundreds of them)
      a visible token has the largest logit.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    for name in ("config.json", "generation_config.json"):  # the gateway and the engine stop on these
        path = hf / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = None
            path.write_text(json.dumps(cfg, indent=2) + "\n")
    tok = AutoTokenizer.from_pretrained(hf)
    special = set(tok.all_special_ids)
    visible = []
    for i in range(len(tok)):
        text = tok.decode([i], skip_special_tokens=True)
        if i not in special and text and all(ord(c) < 128 for c in text):
            visible.append(i)
    shard = next(f for f in sorted(hf.glob("*.safetensors"))
                 if "lm_head.weight" in safe_open(f, "pt").keys())
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata() or {"format": "pt"}
    head = tensors["lm_head.weight"]
    keep = set(visible)
    hidden = [i for i in range(head.shape[0]) if i not in keep]
    if hidden:
        src = torch.tensor([visible[k % len(visible)] for k in range(len(hidden))])
        head[torch.tensor(hidden)] = head[src] * 0.5
    save_file(tensors, shard, metadata=metadata)
    info = {"eos_token_id": None, "visible_tokens": len(visible), "vocab_size": int(head.shape[0]),
            "rule": "lm_head row of every non-visible token = 0.5 x a visible token's row"}
    (hf / BENCH_MODEL_MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return info


def model_limits(path: Path) -> tuple[int, int, set[int]]:
    """(usable vocabulary, context length, end-of-sequence ids) of a block checkpoint. The gateway takes
    prompt ids below its tokenizer's length, which can be less than the model's vocab_size."""
    from transformers import AutoTokenizer

    from libs.checkpoint import CheckpointIndex
    from libs.engine import checkpoint_eos_ids

    index = CheckpointIndex.load(path)
    vocab = min(int(index.config["vocab_size"]), len(AutoTokenizer.from_pretrained(path)))
    return vocab, int(index.config.get("max_position_embeddings", 2048)), checkpoint_eos_ids(path, index)


def prompt_ids(n: int, key: int, vocab: int, avoid: set[int]) -> list[int]:
    """n token ids, deterministic in `key`, never a special or end-of-sequence id."""
    rng = random.Random(key)
    lo = min(SPECIAL_IDS, vocab - 1)
    ids = []
    while len(ids) < n:
        t = rng.randrange(lo, vocab)
        if t not in avoid:
            ids.append(t)
    return ids


# --- one request -------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    scheduled_s: float  # when the trace says (seconds after the replay start)
    sent_s: float  # when it was sent (same origin)
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    ttft_s: float | None = None
    tbt_s: float | None = None  # mean time between tokens (None for a one-token answer)
    tokens: int = 0
    chunks: int = 0  # streamed chunks with a choice (one per token when every token has text)
    finish_reason: str | None = None
    done_s: float | None = None
    error: str | None = None
    chunk_s: list[float] = field(default_factory=list)  # each streamed chunk's arrival, seconds after sending


async def send_one(client: httpx.AsyncClient, url: str, api_key: str, model: str, ids: list[int], max_tokens: int,
                   timeout_s: float, out: Outcome, origin: float) -> Outcome:
    """Stream one completion; fills `out` (times relative to `origin`, a perf_counter value)."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t_sent = time.perf_counter()
    out.sent_s = t_sent - origin
    t_first = t_last = None

    async def run() -> None:
        nonlocal t_first, t_last
        async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {api_key}"}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                raise RuntimeError(f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    return
                ev = json.loads(data)
                if "error" in ev:
                    raise RuntimeError(f"stream error: {ev['error'].get('message', ev['error'])}")
                if ev.get("choices"):
                    now = time.perf_counter()
                    t_first = t_first if t_first is not None else now
                    t_last = now
                    out.chunks += 1
                    out.chunk_s.append(now - t_sent)
                    out.finish_reason = ev["choices"][0].get("finish_reason") or out.finish_reason
                if ev.get("usage"):
                    out.tokens = int(ev["usage"]["completion_tokens"])
            raise RuntimeError("stream ended without [DONE]")

    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        out.error = f"timed out after {timeout_s:g}s"
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
        out.error = str(e) or type(e).__name__
    else:
        if t_first is None:
            out.error = "no token received"
        else:
            out.ok = True
            out.ttft_s = t_first - t_sent
            out.tbt_s = (t_last - t_first) / (out.tokens - 1) if out.tokens > 1 else None
    out.done_s = time.perf_counter() - origin
    return out


def _client(timeout_s: float) -> httpx.AsyncClient:
    # No connection bound: requests go at their trace times, whatever is in flight.
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


@dataclass(frozen=True)
class Send:
    """One request of a replay: when it goes (seconds from the start), to which model, what."""

    at_s: float
    model: str
    prompt: list[int]
    output_tokens: int


async def send_all(url: str, api_key: str, sends: Sequence[Send], timeout_s: float,
                   lead_s: float = 0.5) -> tuple[float, list[Outcome]]:
    """Send every request at its time; returns (wall-clock start of the replay, outcomes in order)."""
    async with _client(timeout_s) as client:
        origin = time.perf_counter() + lead_s
        wall0 = time.time() + lead_s

        async def one(i: int, s: Send) -> Outcome:
            await asyncio.sleep(max(0.0, origin + s.at_s - time.perf_counter()))
            out = Outcome(i, s.at_s, 0.0, len(s.prompt), s.output_tokens)
            return await send_one(client, url, api_key, s.model, s.prompt, s.output_tokens, timeout_s, out, origin)

        outcomes = await asyncio.gather(*(one(i, s) for i, s in enumerate(sends)))
    return wall0, list(outcomes)


async def replay(handle: ClusterHandle, requests: Sequence[ReplayRequest], vocab: int, avoid: set[int], seed: int,
                 timeout_s: float, lead_s: float = 0.5) -> tuple[float, list[Outcome]]:
    """The trace's requests to the handle's model, each at its time."""
    sends = [Send(r.send_at_s, handle.model, prompt_ids(r.prompt_tokens, seed * 1_000_003 + r.row, vocab, avoid),
                  r.output_tokens) for r in requests]
    return await send_all(handle.openai_base_url + "/completions", handle.api_key, sends, timeout_s, lead_s)


# --- SLO calibration ---------------------------------------------------------------------------


async def _sequential(handle: ClusterHandle, n: int, prompt_tokens: int, output_tokens: int, vocab: int,
                      avoid: set[int], timeout_s: float) -> list[Outcome]:
    url = handle.openai_base_url + "/completions"
    outs = []
    async with _client(timeout_s) as client:
        origin = time.perf_counter()
        for i in range(n):
            out = Outcome(i, 0.0, 0.0, prompt_tokens, output_tokens)
            outs.append(await send_one(client, url, handle.api_key, handle.model,
                                       prompt_ids(prompt_tokens, 7_777_777 + i, vocab, avoid), output_tokens,
                                       timeout_s, out, origin))
    return outs


def calibrate(handle: ClusterHandle, requests: Sequence[ReplayRequest], n: int, vocab: int, avoid: set[int],
              timeout_s: float) -> dict:
    """Unloaded TTFT and mean TBT on a warm instance, one request at a time (after one warm-up)."""
    prompt = max(1, round(statistics.median(r.prompt_tokens for r in requests))) if requests else 16
    output = max(8, round(statistics.median(r.output_tokens for r in requests))) if requests else 16
    outs = asyncio.run(_sequential(handle, n + 1, prompt, output, vocab, avoid, timeout_s))[1:]
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(f"SLO calibration: {len(bad)} of {n} requests failed: {bad[0]}")
    return {"unloaded_ttft_s": statistics.median(o.ttft_s for o in outs),
            "unloaded_tbt_s": statistics.median(o.tbt_s for o in outs if o.tbt_s is not None),
            "requests": n, "prompt_tokens": prompt, "output_tokens": output,
            "ttft_samples_s": [round(o.ttft_s, 5) for o in outs],
            "tbt_samples_s": [round(o.tbt_s, 6) for o in outs if o.tbt_s is not None]}


# --- one mode ----------------------------------------------------------------------------------


PER_REQUEST_COLUMNS = ("index", "sent_s", "ttft_s", "tbt_s", "prompt_tokens", "tokens", "error")


def per_request_row(o: Outcome) -> list:
    """One request as the JSON keeps it (PER_REQUEST_COLUMNS; times in seconds after the replay start
    for sent_s, after sending for ttft_s; None where it has none)."""
    def r(x: float | None, digits: int = 5) -> float | None:
        return None if x is None else round(x, digits)

    return [o.index, r(o.sent_s, 4), r(o.ttft_s), r(o.tbt_s, 6), o.prompt_tokens, o.tokens,
            None if o.ok else (o.error or "failed")]


def summarize_mode(mode: str, handle: ClusterHandle, wall0: float, outcomes: Sequence[Outcome],
                   replay_s: float, slo: dict) -> tuple[dict, dict]:
    """The JSON row of a mode and its series for the plot (times relative to the replay start)."""
    done = [wall0 + o.done_s for o in outcomes if o.done_s is not None]
    t_end = max([wall0 + replay_s, *done])
    intervals = handle.recorder.intervals(wall0, t_end, model=handle.model)
    records = handle.recorder.instance_records(handle.model)
    ops = handle.recorder.scale_op_count(since=wall0, until=t_end, model=handle.model)
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    lag = [max(0.0, o.sent_s - o.scheduled_s) for o in outcomes]
    ups = scale_out_times((o.direction, o.timings, o.plan) for o in handle.recorder.scale_ops(
        since=wall0, until=t_end, model=handle.model))
    row = {
        "mode": mode,
        "ttft_s": percentiles((o.ttft_s for o in ok), digits=5),
        "tbt_s": percentiles((o.tbt_s for o in ok if o.tbt_s is not None), digits=6),
        "slo_attainment": slo_attainment([(o.ttft_s, o.tbt_s) if o.ok else (None, None) for o in outcomes],
                                         slo["ttft_s"], slo["tbt_s"]),
        "instance_seconds": round(instance_seconds(intervals.values()), 3),
        "scale_ops": ops["total"],
        "scale_ops_up": ops["up"],
        "scale_ops_down": ops["down"],
        # decision -> operation done, as `layercast simulate` reports it (what --validate compares)
        "scale_out_s": scale_out_summary(ups),
        "scale_outs": ups,
        "instances_started": sum(1 for s, _ in intervals.values() if s > wall0),
        "peak_instances": max((n for _, n in instance_steps(intervals.values(), wall0, t_end)), default=0),
        "requests": len(outcomes),
        "failed": len(failed),
        "failures": dict(Counter(o.error for o in failed).most_common(5)),
        "early_stops": sum(1 for o in ok if o.tokens < o.max_tokens),
        "tokens_without_chunk": sum(max(0, o.tokens - o.chunks) for o in ok),
        "completion_tokens": sum(o.tokens for o in ok),
        "window_s": round(t_end - wall0, 3),
        "send_lag_s": percentiles(lag),
        "settled": handle.settings.get("settled"),  # the deployment was at rest before the replay
        # each instance: [id, start, end (None: still up at the window's end), states seen], replay time
        "instances": [[iid, round(st - wall0, 3), None if en >= t_end else round(en - wall0, 3),
                       [k for k, _ in groupby(r.state for r in records if r.instance_id == iid)]]
                      for iid, (st, en) in sorted(intervals.items(), key=lambda kv: kv[1][0])],
        # every request, to compare one by one (e.g. with `layercast simulate`): the columns below
        "per_request_columns": list(PER_REQUEST_COLUMNS),
        "per_request": [per_request_row(o) for o in sorted(outcomes, key=lambda o: o.index)],
    }
    series = {
        "instances": [(t - wall0, n) for t, n in instance_steps(intervals.values(), wall0, t_end)],
        "ttft_s": sorted(o.ttft_s for o in ok),
        "requests": len(outcomes),
    }
    return row, series


# --- the plot ----------------------------------------------------------------------------------


def plot_results(path: Path, requests: Sequence[ReplayRequest], transform: dict, slo: dict,
                 series: dict[str, dict], attribution: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    duration = transform["replay_duration_s"] or max((r.send_at_s for r in requests), default=1.0) or 1.0
    bin_s = max(0.25, duration / 60)
    fig, (ax_rate, ax_inst, ax_cdf) = plt.subplots(3, 1, figsize=(10, 11.5))
    rates = rate_series([r.send_at_s for r in requests], bin_s, duration)
    ax_rate.step([t for t, _ in rates] + [duration], [v for _, v in rates] + [rates[-1][1]], where="post",
                 color="black")
    ax_rate.set_ylabel("requests / s")
    ax_rate.set_title(f"request rate (bins of {bin_s:.2g} s)")
    x_max = duration
    for mode, s in series.items():
        ts, ns = zip(*s["instances"]) if s["instances"] else ((0.0,), (0,))
        ax_inst.step(ts, ns, where="post", label=mode)
        x_max = max(x_max, ts[-1])
    ax_inst.set_ylabel("instances")
    ax_inst.set_title("instances over time (loading, ready or draining)")
    ax_inst.legend()
    for ax in (ax_rate, ax_inst):
        ax.set_xlim(0, x_max)
        ax.set_xlabel("replay time (s)")
    for mode, s in series.items():
        xs = s["ttft_s"]
        if xs:
            ax_cdf.step([xs[0], *xs], [0.0, *((i + 1) / s["requests"] for i in range(len(xs)))], where="post",
                        label=mode)
    ax_cdf.axvline(slo["ttft_s"], color="grey", linestyle="--", label=f"SLO {slo['ttft_s']:.3g} s")
    ax_cdf.set_xscale("log")
    ax_cdf.set_ylim(0, 1.02)
    ax_cdf.set_xlabel("TTFT (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF (failed requests never reach the top)")
    ax_cdf.legend()
    fig.suptitle(title)
    tf = transform

    def fitted(kind: str) -> str:
        cap, how = tf[f"max_{kind}_tokens"], tf[f"{kind}_scaling"]
        return f"{kind} tokens as in the trace" if cap is None else \
            f"{kind} tokens {'scaled' if how == 'scale' else 'clipped'} to <= {cap}"

    end = f"{tf['start_s'] + tf['duration_s']:g}" if tf["duration_s"] is not None else "end"
    caption = (f"Transform: window [{tf['start_s']:g} s, {end}) of the trace ({tf['window_rows']} rows), thinned "
               f"to x{tf['rate_scale']:g} (seed {tf['seed']}), time / {tf['time_scale']:g}: {tf['requests']} "
               f"requests in {tf['replay_duration_s']:g} s; {fitted('prompt')}, {fitted('output')}. "
               f"SLO = {slo['factor']:g}x unloaded: TTFT {slo['ttft_s']:.3g} s, TBT {slo['tbt_s']:.3g} s. "
               f"Trace: {attribution}.")
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(caption, 150)), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the whole benchmark -----------------------------------------------------------------------


@dataclass
class TraceBenchConfig:
    workers: int = 2
    max_instances: int | None = None  # default: workers
    preset: str = "tiny"
    blocks: int = 2
    model_path: Path | None = None  # a block checkpoint of your own (default: bench_model's demo)
    keep_alive_s: float = 3.0
    scale_down_delay_s: float = 5.0  # damps scale-in right after a panic scale-out
    policy: str = "concurrency"  # the deployment's scaling policy and its parameters
    policy_params: dict = field(default_factory=dict)
    # How long a serverlessllm worker keeps a scaled-in model in host memory. None: λScale §2.3's
    # 15 s of trace time, so divided by the time scale like the trace's gaps are.
    serverlessllm_keep_alive_s: float | None = None
    target_concurrency: int = 2
    slo_factor: float = 5.0
    calibration_requests: int = 5
    slo_ttft_s: float | None = None  # both given: no calibration
    slo_tbt_s: float | None = None
    request_timeout_s: float = 120.0
    emulate: bool = False
    profile: Any = None
    torch_threads: int = 1


def run_trace_benchmark(trace: Path, modes: Sequence[str], tf: Transform, cfg: TraceBenchConfig, state_dir: Path,
                        plot: Path | None = None, attribution: str | None = None,
                        log: Callable[[str], None] = _log) -> dict:
    trace = Path(trace)
    attribution = attribution or attribution_for(trace)
    rows = parse_trace(trace)
    requests = apply_transform(rows, tf)
    summary = transform_summary(rows, tf, requests)
    if not requests:
        raise ValueError("the transformed trace has no requests: widen --duration-s or raise --rate-scale")
    state_dir = Path(state_dir).resolve() / "bench-trace"
    model = Path(cfg.model_path) if cfg.model_path else bench_model(state_dir, cfg.preset, cfg.blocks)
    vocab, context, eos = model_limits(model)
    need = max(r.prompt_tokens + r.output_tokens for r in requests)
    if need > context:
        raise ValueError(f"a request needs {need} tokens of context, the model has {context}: lower "
                         "--max-prompt-tokens / --max-output-tokens")
    max_instances = cfg.max_instances or cfg.workers
    host_keep_alive_s = (cfg.serverlessllm_keep_alive_s if cfg.serverlessllm_keep_alive_s is not None
                         else SERVERLESSLLM_KEEP_ALIVE_S / tf.time_scale)
    replay_s = summary["replay_duration_s"] or requests[-1].send_at_s
    common = dict(workers=cfg.workers, model_path=model, emulate=cfg.emulate, profile=cfg.profile,
                  keep_alive_s=cfg.keep_alive_s, target_concurrency=cfg.target_concurrency,
                  scale_down_delay_s=cfg.scale_down_delay_s, queue_timeout_s=cfg.request_timeout_s,
                  max_context=context, torch_threads=cfg.torch_threads,
                  serverlessllm_keep_alive_s=host_keep_alive_s, policy=cfg.policy,
                  policy_params=dict(cfg.policy_params))
    log(f"{len(requests)} requests over {replay_s:g} s (of {len(rows)} trace rows); model {model}")

    if cfg.slo_ttft_s is not None and cfg.slo_tbt_s is not None:
        slo = {"ttft_s": cfg.slo_ttft_s, "tbt_s": cfg.slo_tbt_s, "factor": cfg.slo_factor, "calibrated": False}
    else:
        log("calibrating the SLO: one warm instance, one request at a time")
        with mode_cluster("static", state_dir=state_dir / "calibration", min_instances=1, max_instances=1,
                          **common) as h:
            log("calibration cluster up")
            cal = calibrate(h, requests, cfg.calibration_requests, vocab, eos, cfg.request_timeout_s)
        slo = {"ttft_s": round(cfg.slo_factor * cal["unloaded_ttft_s"], 5),
               "tbt_s": round(cfg.slo_factor * cal["unloaded_tbt_s"], 6), "factor": cfg.slo_factor,
               "calibrated": True, **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in cal.items()}}
    log(f"SLO: TTFT <= {slo['ttft_s']:.4g} s, mean TBT <= {slo['tbt_s']:.4g} s")

    results, series, settings = [], {}, None
    for mode in modes:
        log(f"{mode}: starting a fresh cluster ({cfg.workers} workers)")
        # static: a fleet for the peak (max_instances), loaded before the replay starts
        min_instances = max_instances if mode == "static" else 0
        with mode_cluster(mode, state_dir=state_dir / mode, min_instances=min_instances,
                          max_instances=max_instances, **common) as h:
            log(f"{mode}: cluster up, model deployed; replaying")
            wall0, outcomes = asyncio.run(replay(h, requests, vocab, eos, tf.seed, cfg.request_timeout_s))
            time.sleep(0.5)  # the last instance / scale-op events
            row, s = summarize_mode(mode, h, wall0, outcomes, replay_s, slo)
            settings = settings or {k: v for k, v in h.settings.items() if k not in ("mode",)}
            log(f"{mode}: replay done; stopping the cluster")
        log(f"{mode}: ttft p50 {row['ttft_s']['p50']} s, p99 {row['ttft_s']['p99']} s, "
            f"slo {row['slo_attainment']}, {row['instance_seconds']} instance-s, {row['scale_ops']} scale ops, "
            f"{row['failed']} failed")
        results.append(row)
        series[mode] = s

    settings = dict(settings or {})
    for key in ("deploy", "settled", "settle_s"):  # per mode: in the results
        settings.pop(key, None)
    settings.update({
        "model": str(model), "model_preset": None if cfg.model_path else cfg.preset, "blocks": cfg.blocks,
        "bench_model": (json.loads((model / BENCH_MODEL_MARKER).read_text())
                        if (model / BENCH_MODEL_MARKER).exists() else None),
        "vocab_size": vocab, "context": context, "eos_ids": sorted(eos),
        "max_instances": max_instances, "keep_alive_s": cfg.keep_alive_s,
        "serverlessllm_keep_alive_s": host_keep_alive_s,
        "scale_down_delay_s": cfg.scale_down_delay_s, "target_concurrency": cfg.target_concurrency,
        "policy": cfg.policy, "policy_params": dict(cfg.policy_params),
        "static_min_instances": max_instances, "request_timeout_s": cfg.request_timeout_s,
        "request": "POST /v1/completions, prompt as token ids, max_tokens = output tokens, temperature 0, stream",
        "instance_seconds": "per instance: first event (loading) to stopped/failed, clipped to [replay start, "
                            "max(replay end, last request done)]",
        "scale_ops": "scale operations first recorded inside that window",
        "tbt": "per request: (last token - first token) / (completion tokens - 1); percentiles over requests",
        "slo_attainment": "share of all requests (failed ones miss) with TTFT <= slo.ttft_s and mean TBT <= "
                          "slo.tbt_s",
    })
    out = {"trace": str(trace), "attribution": attribution, "transform": summary, "settings": settings, "slo": slo,
           "results": results}
    if plot is not None:
        plot_results(Path(plot), requests, summary, slo, series, attribution,
                     f"trace replay: {trace.name}; {cfg.workers} workers{' (emulated)' if cfg.emulate else ''}, "
                     f"keep-alive {cfg.keep_alive_s:g} s, target {cfg.target_concurrency} in flight / instance\n"
                     f"serverlessllm keeps a stopped model in host memory {host_keep_alive_s:g} s")
        out["plot"] = str(plot)
    return out


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ValueError("no modes given")
    if len(set(modes)) != len(modes):
        raise ValueError(f"a mode is repeated in {text!r}")
    return modes


def to_jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return to_jsonable(asdict(value))
    return value
