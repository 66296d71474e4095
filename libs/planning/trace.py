"""Request traces, the pure part shared by `layercast bench trace` (benchmarks/trace_replay.py)
and `layercast simulate` (libs/sim): parse a trace CSV (the Azure LLM inference traces 2023,
CC-BY-4.0: keep the attribution next to anything derived from them) and transform it to fit a
cluster. See benchmarks/trace_replay.py's module doc for the transformation's steps.

No I/O except `parse_trace`'s reading of a file; everything is deterministic.
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["TOKEN_SCALINGS", "ReplayRequest", "TraceRow", "Transform", "apply_transform", "fit_tokens",
           "parse_trace", "thinning_draws"]

TOKEN_SCALINGS = ("scale", "clip")


@dataclass(frozen=True)
class TraceRow:
    t_s: float  # seconds since the first row of the trace
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ReplayRequest:
    send_at_s: float  # seconds after the replay starts
    prompt_tokens: int
    output_tokens: int
    row: int  # index of the trace row it comes from


@dataclass(frozen=True)
class Transform:
    time_scale: float = 1.0  # >1 compresses time: 10 replays 30 min in 3 min
    rate_scale: float = 1.0  # fraction of rows kept, in (0, 1]
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    prompt_scaling: str = "scale"  # scale | clip (see the module doc)
    output_scaling: str = "clip"
    start_s: float = 0.0  # skip the trace's first start_s seconds
    duration_s: float | None = None  # then keep this many seconds (None: the rest)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not 0 < self.rate_scale <= 1:
            raise ValueError(f"rate_scale must be in (0, 1], got {self.rate_scale}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            cap = getattr(self, name)
            if cap is not None and cap < 1:
                raise ValueError(f"{name} must be >= 1, got {cap}")
        for name in ("prompt_scaling", "output_scaling"):
            if getattr(self, name) not in TOKEN_SCALINGS:
                raise ValueError(f"{name} must be one of {TOKEN_SCALINGS}, got {getattr(self, name)!r}")
        if self.start_s < 0:
            raise ValueError(f"start_s must be >= 0, got {self.start_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")


# --- parsing ----------------------------------------------------------------------------------


def _timestamp_s(text: str) -> float:
    """Seconds of a TIMESTAMP: plain seconds, or 'YYYY-MM-DD HH:MM:SS[.fraction]' (any digits)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    whole, _, frac = text.partition(".")
    dt = datetime.fromisoformat(whole.replace("T", " "))
    return dt.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def parse_trace(source: str | Path | Iterable[str]) -> list[TraceRow]:
    """Rows of a trace CSV (a path, or its lines), in time order (stable for equal times),
    with times relative to the first row."""
    if isinstance(source, (str, Path)):
        lines: Iterable[str] = io.StringIO(Path(source).read_text())
    else:
        lines = source
    reader = csv.DictReader(lines)
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
    if missing:
        raise ValueError(f"trace lacks the columns {sorted(missing)} (has {reader.fieldnames})")
    raw = []
    for n, rec in enumerate(reader, start=2):
        try:
            raw.append((_timestamp_s(rec["TIMESTAMP"]), int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
        except (TypeError, ValueError) as e:
            raise ValueError(f"line {n}: cannot parse {rec}: {e}") from None
    if not raw:
        return []
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    return [TraceRow(t - t0, max(0, p), max(0, g)) for t, p, g in raw]


# --- the transformation -----------------------------------------------------------------------


def fit_tokens(values: Sequence[int], cap: int | None, how: str) -> list[int]:
    """Lengths fitted under `cap`: `scale` multiplies by cap / max(values) (only when the max is
    over the cap), `clip` takes min(v, cap); every result is at least 1."""
    if cap is None:
        return [max(1, v) for v in values]
    if how == "clip":
        return [max(1, min(v, cap)) for v in values]
    if how != "scale":
        raise ValueError(f"token scaling must be one of {TOKEN_SCALINGS}, got {how!r}")
    top = max(values, default=0)
    if top <= cap:
        return [max(1, v) for v in values]
    return [max(1, min(cap, round(v * cap / top))) for v in values]


def thinning_draws(n_rows: int, seed: int) -> list[float]:
    """u_i for every row of the file: row i survives a rate r iff u_i < r."""
    rng = random.Random(seed)
    return [rng.random() for _ in range(n_rows)]


def apply_transform(rows: Sequence[TraceRow], tf: Transform) -> list[ReplayRequest]:
    """The requests to replay, in send order (see the module doc for the steps)."""
    end = math.inf if tf.duration_s is None else tf.start_s + tf.duration_s
    window = [i for i, r in enumerate(rows) if tf.start_s <= r.t_s < end]
    prompts = fit_tokens([rows[i].prompt_tokens for i in window], tf.max_prompt_tokens, tf.prompt_scaling)
    outputs = fit_tokens([rows[i].output_tokens for i in window], tf.max_output_tokens, tf.output_scaling)
    draws = thinning_draws(len(rows), tf.seed)
    return [ReplayRequest((rows[i].t_s - tf.start_s) / tf.time_scale, p, o, i)
            for i, p, o in zip(window, prompts, outputs) if draws[i] < tf.rate_scale]
