"""The simulator's profile file: every figure the time models need, each with where it comes from.

A profile is a JSON object::

    {"name": "...", "description": "...",
     "values": {"link_gbps": 200, ...},            # each a number or {"value": x, "cite": "..."}
     "compute": {"prefill_lengths": [...], "prefill_s": [...], "batches": [...], "lengths": [...],
                 "decode_s": [[...], ...], "cite": "..."}}

``compute`` is the LLM-Mesh profile format the registry keeps (libs.protocol ModelProfile; what
`layercast model profile --out` writes), checked by libs.planning.mesh_profiles. ``values``
(:data:`FIELDS` names each, its unit and default): a published profile gives every number as
``{"value": x, "cite": "paper, section/table"}``; a measured one may give plain numbers.
Bad input raises :class:`ProfileError` naming the field.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from libs.planning.mesh import Profile
from libs.planning.mesh_profiles import InvalidProfile, profile_from_message
from libs.protocol import messages as m

__all__ = ["FIELDS", "ProfileError", "SimProfile", "load_profile", "profile_from_dict", "serving_overheads"]

# name -> (unit, default, what it is)
FIELDS: dict[str, tuple[str, float, str]] = {
    "link_gbps": ("Gbit/s", 10.0, "each worker's network link (both directions)"),
    "scaleup_gbps": ("Gbit/s", 0.0, "a scale-up group's fast path between its members (0: none)"),
    "step_overhead_s": ("s", 0.003, "what one block transfer costs beyond its bytes (grant, framing)"),
    "chunk_bytes": ("bytes", 4 << 20, "cut-through relay chunk of a chain"),
    "disk_gbytes_per_s": ("GB/s", 1.0, "a worker's checkpoint read rate from local disk"),
    "disk_read_latency_s": ("s", 0.0, "per block read from disk"),
    "h2d_gbytes_per_s": ("GB/s", 10.0, "host memory -> engine memory copy rate"),
    "h2d_latency_s": ("s", 0.0, "per block copied to engine memory"),
    "engine_build_s": ("s", 0.0, "building an engine for a new instance (beside its blocks' load)"),
    "nats_hop_s": ("s", 0.001, "one message over the bus (a command, an answer, an event)"),
    "registry_read_s": ("s", 0.005, "the planner reading the cluster view"),
    "pipeline_hop_s": ("s", 0.0005, "activations between two stages of an execution pipeline, per iteration"),
    "request_overhead_s": ("s", 0.0, "a request's path to the engine beyond its prefill (the gateway's parse and "
                           "routing, the bus hops, the wait for the worker's CPU): the request reaches the gateway's "
                           "queue this much after it was sent"),
    "token_overhead_s": ("s", 0.0, "what each row of a decode iteration costs beyond the engine's step (the "
                         "worker's per-token publish and bookkeeping, on the worker's CPU share)"),
    "model_bytes": ("bytes", 1 << 30, "the model's weights"),
    "n_blocks": ("blocks", 16, "blocks the model is cut into"),
    "max_batch": ("requests", 8, "requests an instance runs at once (its KV slots)"),
}


class ProfileError(ValueError):
    """A profile file that cannot be used; names the field."""


@dataclass(frozen=True)
class SimProfile:
    name: str
    values: Mapping[str, float]
    compute: Profile
    citations: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    def __getattr__(self, key: str) -> float:
        if key in FIELDS:
            return self.values[key]
        raise AttributeError(key)

    def with_values(self, **values: float) -> SimProfile:
        bad = sorted(set(values) - set(FIELDS))
        if bad:
            raise ProfileError(f"unknown profile value {bad[0]!r}")
        return SimProfile(self.name, MappingProxyType({**self.values, **values}), self.compute,
                          self.citations, self.description)


def _number(key: str, raw: object) -> tuple[float, str]:
    cite = ""
    if isinstance(raw, Mapping):
        if "value" not in raw:
            raise ProfileError(f"values.{key}: an object needs 'value' (and 'cite')")
        cite = str(raw.get("cite", ""))
        raw = raw["value"]
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
        raise ProfileError(f"values.{key}: must be a finite number >= 0, got {raw!r}")
    return float(raw), cite


def profile_from_dict(data: Mapping, name: str = "") -> SimProfile:
    if not isinstance(data, Mapping):
        raise ProfileError("a profile is a JSON object")
    raw_values = data.get("values", {})
    if not isinstance(raw_values, Mapping):
        raise ProfileError("values: must be an object")
    unknown = sorted(set(raw_values) - set(FIELDS))
    if unknown:
        raise ProfileError(f"values.{unknown[0]}: unknown (known: {', '.join(FIELDS)})")
    values: dict[str, float] = {k: d for k, (_, d, _) in FIELDS.items()}
    cites: dict[str, str] = {}
    for key, raw in raw_values.items():
        values[key], cite = _number(key, raw)
        if cite:
            cites[key] = cite
    for key in ("link_gbps", "disk_gbytes_per_s", "h2d_gbytes_per_s", "model_bytes", "n_blocks", "max_batch"):
        if values[key] <= 0:
            raise ProfileError(f"values.{key}: must be > 0")
    for key in ("n_blocks", "max_batch", "model_bytes", "chunk_bytes"):
        values[key] = int(values[key])
    comp = data.get("compute")
    if not isinstance(comp, Mapping):
        raise ProfileError("compute: needs the LLM-Mesh profile (prefill_lengths, prefill_s, batches, lengths, "
                           "decode_s), as `layercast model profile --out` writes it")
    try:
        msg = m.ModelProfile(model="sim", device="cuda", **{k: comp[k] for k in (
            "prefill_lengths", "prefill_s", "batches", "lengths", "decode_s")})
        compute = profile_from_message(msg)
    except KeyError as e:
        raise ProfileError(f"compute.{e.args[0]}: missing") from None
    except InvalidProfile as e:
        raise ProfileError(f"compute.{e}") from None
    except ValueError as e:  # pydantic's
        raise ProfileError(f"compute: {e}") from None
    if comp.get("cite"):
        cites["compute"] = str(comp["cite"])
    return SimProfile(str(data.get("name", name)), MappingProxyType(values), compute, MappingProxyType(cites),
                      str(data.get("description", "")))


def load_profile(path: str | Path) -> SimProfile:
    p = Path(path)
    if not p.exists() and not p.suffix and (Path(__file__).parent / "profiles" / f"{p}.json").exists():
        p = Path(__file__).parent / "profiles" / f"{p}.json"  # a committed profile by name
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"no profile file {path}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not JSON: {e}") from None
    return profile_from_dict(data, p.stem)


def serving_overheads(compute: Profile, calibrations: list[Mapping]) -> dict[str, float]:
    """``request_overhead_s`` and ``token_overhead_s`` from unloaded serving measured end to end
    (`layercast bench trace`'s SLO calibration: one warm instance, one request at a time, before
    any replay): what the client saw beyond the compute profile's prefill of the prompt and its
    one-row decode iteration, medians over the calibrations, never below 0.

    Each calibration: ``unloaded_ttft_s``, ``unloaded_tbt_s``, ``prompt_tokens``, ``output_tokens``."""
    if not calibrations:
        raise ProfileError("serving overheads need at least one calibration")
    req, tok = [], []
    for i, c in enumerate(calibrations):
        try:
            prompt, output = int(c["prompt_tokens"]), int(c["output_tokens"])
            ttft, tbt = float(c["unloaded_ttft_s"]), float(c["unloaded_tbt_s"])
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"calibration {i}: needs unloaded_ttft_s, unloaded_tbt_s, prompt_tokens and "
                               f"output_tokens ({e})") from None
        if prompt < 1 or output < 1 or not (math.isfinite(ttft) and math.isfinite(tbt)) or ttft < 0 or tbt < 0:
            raise ProfileError(f"calibration {i}: lengths must be >= 1 and times finite and >= 0")
        req.append(ttft - compute.prefill_time(prompt))
        # the mean row length over its decode: the prompt and half the output
        tok.append(tbt - compute.decode_time(1, prompt + output / 2))
    return {"request_overhead_s": round(max(0.0, statistics.median(req)), 6),
            "token_overhead_s": round(max(0.0, statistics.median(tok)), 6)}
