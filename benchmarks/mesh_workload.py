"""The multi-model workload of `layercast bench mesh` (LLM-Mesh, issue 23): the pure part.

No public multi-model LLM trace exists. LLM-Mesh (§8, following ServerlessLLM) fires requests
from the Azure Functions (serverless) trace, one model per function, with lengths sampled from
the Azure LLM conversation trace. Here only the Azure LLM inference traces 2023 are at hand
(`shared/traces/`, CC-BY-4.0, attribution in `AZURE_ATTRIBUTION`), so:

1. the trace's rows give the arrival times and the prompt/output lengths (one row, one
   request), transformed as `layercast bench trace` does (benchmarks/trace_replay.py): the
   whole trace (or `window_s` of it) is time-compressed to `duration_s`; a seeded,
   deterministic thinning keeps `target_rps * duration_s` rows on average (uniform thinning
   keeps the temporal shape); prompts are scaled under `max_prompt_tokens` (x cap / observed
   max: keeps the length distribution's shape), outputs clipped to `max_output_tokens`;
2. each request goes to one of K models by a seeded Zipf mapping: model ranks are a seeded
   permutation of the K models, and request i's rank is drawn with P(rank r) proportional to
   1 / r^s (s = `zipf_s`, 1.0 by default) from `random.Random(seed)`. The same seed gives the same
   models for the same requests; every setting of a benchmark replays the same list.

No I/O except reading the trace file; everything is deterministic.
"""

from __future__ import annotations

import bisect
import math
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.trace_replay import TraceRow, Transform, apply_transform, parse_trace

AZURE_ATTRIBUTION = ("Azure LLM inference traces 2023 (Azure/AzurePublicDataset, AzureLLMInferenceTrace_{kind}.csv, "
                     "collected from Azure OpenAI GPT services on 2023-11-16), CC-BY-4.0")
TRACE_FILES = {"conv": "azure_llm_conv_2023_first30min.csv", "code": "azure_llm_code_2023_first30min.csv"}
TRACES_ENV = "LAYERCAST_TRACES_DIR"


def resolve_trace(trace: str | Path) -> Path:
    """The trace file for `conv` / `code` (the Azure LLM traces) or a path, found independently of
    the current directory: $LAYERCAST_TRACES_DIR, then `shared/traces/` next to any ancestor of
    this file (a worktree's `../shared/traces`), then the path as given."""
    name = TRACE_FILES.get(str(trace))
    if name is None:
        path = Path(trace).expanduser()
        if path.is_file():
            return path.resolve()
        raise FileNotFoundError(f"no trace file {trace!r} (give conv, code, or a CSV path)")
    candidates = []
    if os.environ.get(TRACES_ENV):
        candidates.append(Path(os.environ[TRACES_ENV]) / name)
    for parent in Path(__file__).resolve().parents:
        candidates.append(parent / "shared" / "traces" / name)
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise FileNotFoundError(f"trace {name} not found (set {TRACES_ENV}); looked in "
                            f"{', '.join(str(c.parent) for c in candidates[:4])}, ...")


def attribution(path: Path) -> str:
    name = path.name.lower()
    kind = "code" if "code" in name else "conv" if "conv" in name else None
    return AZURE_ATTRIBUTION.format(kind=kind) if kind and "azure" in name else f"trace {path.name}"


# --- the Zipf mapping ---------------------------------------------------------------------------


def zipf_weights(k: int, s: float = 1.0) -> list[float]:
    """P(rank r) for r = 1..k, proportional to 1 / r^s."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if s < 0:
        raise ValueError(f"the Zipf exponent must be >= 0, got {s}")
    raw = [1.0 / (r ** s) for r in range(1, k + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def zipf_mapping(n: int, k: int, seed: int, s: float = 1.0) -> list[int]:
    """Model index (0..k-1) of each of n requests: a seeded permutation says which model has
    which popularity rank, then each request's rank is a seeded Zipf draw."""
    rng = random.Random(f"mesh-zipf:{seed}")
    ranked = list(range(k))
    rng.shuffle(ranked)  # ranked[r]: the model with rank r + 1
    cum, acc = [], 0.0
    for w in zipf_weights(k, s):
        acc += w
        cum.append(acc)
    cum[-1] = 1.0
    return [ranked[min(k - 1, bisect.bisect_left(cum, rng.random()))] for _ in range(n)]


# --- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshRequest:
    send_at_s: float  # seconds after the replay starts
    model: int  # 0..K-1
    prompt_tokens: int
    output_tokens: int
    row: int  # the trace row it comes from


@dataclass(frozen=True)
class MeshWorkloadSpec:
    models: int
    duration_s: float  # the replay's length: the trace (window) is compressed to it
    target_rps: float = 2.0  # mean request rate of the replay (sets the thinning)
    seed: int = 0
    zipf_s: float = 1.0
    window_s: float | None = None  # the trace's first window_s seconds (None: all of it)
    max_prompt_tokens: int = 128
    max_output_tokens: int = 16

    def __post_init__(self) -> None:
        if self.models < 1:
            raise ValueError(f"models must be >= 1, got {self.models}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.target_rps > 0:
            raise ValueError(f"target_rps must be > 0, got {self.target_rps}")
        if self.window_s is not None and not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


def transform_for(rows: Sequence[TraceRow], spec: MeshWorkloadSpec) -> Transform:
    """The trace_replay transformation that compresses the trace (window) to spec.duration_s and thins
    it to spec.target_rps on average."""
    span = spec.window_s if spec.window_s is not None else (rows[-1].t_s if rows else 0.0)
    # Times in [0, span] map to [0, duration_s); a hair more than span keeps the last row inside.
    span = max(span, 1e-9) * (1 + 1e-9)
    in_window = sum(1 for r in rows if r.t_s < span)
    rate_scale = min(1.0, spec.target_rps * spec.duration_s / max(1, in_window))
    return Transform(time_scale=span / spec.duration_s, rate_scale=rate_scale,
                     max_prompt_tokens=spec.max_prompt_tokens, max_output_tokens=spec.max_output_tokens,
                     prompt_scaling="scale", output_scaling="clip", start_s=0.0, duration_s=span, seed=spec.seed)


def build_workload(rows: Sequence[TraceRow], spec: MeshWorkloadSpec) -> tuple[list[MeshRequest], dict]:
    """The requests (send order) and a summary of how they were made (for the JSON report)."""
    tf = transform_for(rows, spec)
    replay = apply_transform(rows, tf)
    models = zipf_mapping(len(replay), spec.models, spec.seed, spec.zipf_s)
    requests = [MeshRequest(min(r.send_at_s, spec.duration_s), m, r.prompt_tokens, r.output_tokens, r.row)
                for r, m in zip(replay, models)]
    per_model = [0] * spec.models
    for r in requests:
        per_model[r.model] += 1
    summary = {
        **asdict(spec),
        "trace_rows": len(rows),
        "trace_span_s": round(tf.duration_s or 0.0, 3),
        "time_scale": round(tf.time_scale, 4),
        "rate_scale": round(tf.rate_scale, 6),
        "requests": len(requests),
        "requests_per_model": per_model,
        "order": "window -> prompts scaled (x cap / window max) and outputs clipped -> seeded thinning -> "
                 "time / time_scale -> seeded Zipf model mapping",
        "mapping": "no public multi-model LLM trace exists; as LLM-Mesh (after ServerlessLLM) maps models "
                   "onto Azure Functions invocations, each request of the Azure LLM trace goes to a model "
                   "drawn from Zipf(s) over a seeded ranking of the K models",
    }
    return requests, summary


def load_workload(trace: str | Path, spec: MeshWorkloadSpec) -> tuple[list[MeshRequest], dict, Path]:
    path = resolve_trace(trace)
    requests, summary = build_workload(parse_trace(path), spec)
    summary["trace"] = str(path)
    summary["attribution"] = attribution(path)
    return requests, summary, path


# --- temporal shape -----------------------------------------------------------------------------


def counts_per_bin(times_s: Sequence[float], bin_s: float, duration_s: float) -> list[int]:
    """How many of the times fall in each bin of [0, duration_s) (the last bin takes the end)."""
    n = max(1, math.ceil(duration_s / bin_s - 1e-9))
    counts = [0] * n
    for t in times_s:
        if t >= 0:
            counts[min(n - 1, int(t // bin_s))] += 1
    return counts


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("pearson needs two series of the same length >= 2")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0
