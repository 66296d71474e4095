"""`layercast bench serve`: the serving path against the engine, in one run.

A one-worker cluster serves the model; 1, 4 and 16 concurrent streamed completions go through
the gateway (the prompts are the engine benchmark's: 128 random token ids, greedy). For each
concurrency it reports the streams' decode tokens/s (the tokens all streams got between the last
first token and the first last token, over that window: every stream decoding, no prefill in
it, as in the engine's figure), TTFT and inter-token
p50/p99, next to the engine's own decode tokens/s at the same batch size, measured in this
process on the same checkpoint with the same torch threads (`bench engine`'s method). The
engine's figure is the bound: the ratio says what the path around it (gateway, NATS, worker,
detokenization, HTTP) costs. Every figure is the median of `repeat` trials, each trial listed.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch

from benchmarks.bench_engine import PROMPT_LEN, _decode_rate, _prompts

CONCURRENCY = (1, 4, 16)


def _stream(base_url: str, key: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: when each token's chunk arrived."""
    times: list[float] = []
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=300,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
    return {"started": started, "times": times}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _serve_trial(base_url: str, key: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    results: list[dict] = [{} for _ in prompts]

    def run(i: int) -> None:
        results[i] = _stream(base_url, key, model, prompts[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # The decode rate while every stream decodes (as the engine's figure: no prefill in it): the
    # tokens all streams got between the last first token and the first last token.
    # A stream that ended (EOS) before the last one started is left out of the window; if no
    # window is left, the rate over the whole run stands in.
    start = max(r["times"][0] for r in results)
    alive = [r for r in results if r["times"][-1] > start]
    end = min((r["times"][-1] for r in alive), default=start)
    if end > start:
        rate = sum(sum(1 for t in r["times"] if start < t <= end) for r in alive) / (end - start)
    else:
        first, last = min(r["times"][0] for r in results), max(r["times"][-1] for r in results)
        rate = sum(len(r["times"]) - 1 for r in results) / (last - first)
    ttft = [r["times"][0] - r["started"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    return {"tokens_per_s": rate, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "itl_p50_s": _pct(itl, 0.5), "itl_p99_s": _pct(itl, 0.99),
            "tokens": sum(len(r["times"]) for r in results)}


def engine_rates(path: Path, new_tokens: int, repeat: int) -> dict[str, list[float]]:
    """The engine's decode tokens/s at each concurrency as a batch, in this process: every trial."""
    from libs.engine import Engine

    engine = Engine.from_checkpoint(path, max_batch_size=max(CONCURRENCY), max_seq_len=PROMPT_LEN + new_tokens + 8,
                                    eos_token_ids=(), token_budget=8192)
    _decode_rate(engine, 2, 4)  # warm-up
    return {str(c): [_decode_rate(engine, c, new_tokens) for _ in range(repeat)] for c in CONCURRENCY}


def run_serve_benchmark(handle, path: Path, new_tokens: int = 32, repeat: int = 3) -> dict:
    """`handle`: a running one-worker cluster (benchmarks.harness.mode_cluster) serving `path`."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    # Warm-up: the instance is up and its kernels ran once.
    _serve_trial(handle.gateway_url, handle.api_key, handle.model, _prompts(1, vocab, seed=9), 4)
    serve: dict[str, list[dict]] = {str(c): [] for c in CONCURRENCY}
    for _ in range(repeat):  # interleaved, so drift hits every concurrency alike
        for c in CONCURRENCY:
            serve[str(c)].append(_serve_trial(handle.gateway_url, handle.api_key, handle.model,
                                              _prompts(c, vocab, seed=c), new_tokens))
    engine = engine_rates(path, new_tokens, repeat)
    out: dict = {"model": str(path), "prompt_tokens": PROMPT_LEN, "new_tokens": new_tokens, "repeat": repeat,
                 "torch_threads": torch.get_num_threads(), "concurrency": {}}
    for c in CONCURRENCY:
        trials = serve[str(c)]
        med = {k: round(statistics.median(t[k] for t in trials), 4) for k in trials[0] if k != "tokens"}
        eng = statistics.median(engine[str(c)])
        out["concurrency"][str(c)] = {
            **med, "engine_tokens_per_s": round(eng, 2),
            "serve_over_engine": round(med["tokens_per_s"] / eng, 3),
            "trials": [{k: round(v, 4) for k, v in t.items()} for t in trials],
            "engine_trials": [round(v, 2) for v in engine[str(c)]]}
    return out
