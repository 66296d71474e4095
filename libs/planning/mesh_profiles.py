"""LLM-Mesh profiles between their two forms: :class:`libs.planning.mesh.Profile` (what the
scheduler computes with) and :class:`libs.protocol.messages.ModelProfile` (what the registry
stores and workers fetch). Here so the registry, the worker and the CLI share one checked
conversion; pure, like the rest of libs.planning.
"""

from __future__ import annotations

import math

from libs.planning.mesh import Profile
from libs.protocol import messages as m

__all__ = ["InvalidProfile", "device_kind", "profile_from_message", "profile_to_message"]


class InvalidProfile(ValueError):
    """A profile message that is not a usable profile; `field` names the offending field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


def device_kind(device: str) -> str:
    """The kind a profile is kept under for a torch device string: "cuda:1" -> "cuda"."""
    kind = device.split(":", 1)[0].strip().lower()
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is neither cpu nor cuda[:n]")
    return kind


def profile_to_message(model: str, device: str, profile: Profile, source: str = "") -> m.ModelProfile:
    return m.ModelProfile(model=model, device=device_kind(device), prefill_lengths=list(profile.prefill_lengths),
                          prefill_s=list(profile.prefill_s), batches=list(profile.batches),
                          lengths=list(profile.lengths), decode_s=[list(r) for r in profile.decode_s],
                          source=source)


def _check_points(field: str, xs: list[int]) -> None:
    if any(x < 1 for x in xs):
        raise InvalidProfile(field, f"sample points must be >= 1, got {xs}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise InvalidProfile(field, f"sample points must be strictly ascending, got {xs}")


def _check_times(field: str, ts: list[float]) -> None:
    bad = next((t for t in ts if not math.isfinite(t) or t < 0), None)
    if bad is not None:
        raise InvalidProfile(field, f"times must be finite and >= 0, got {bad}")


def profile_from_message(msg: m.ModelProfile) -> Profile:
    """The message's profile; :class:`InvalidProfile` (naming the field) when its arrays disagree
    in shape, its sample points are not strictly ascending, or a time is negative or not finite."""
    for field in ("prefill_lengths", "batches", "lengths"):
        _check_points(field, getattr(msg, field))
    if len(msg.prefill_s) != len(msg.prefill_lengths):
        raise InvalidProfile("prefill_s", f"{len(msg.prefill_s)} times for {len(msg.prefill_lengths)} "
                                          "prefill_lengths: one per length")
    if len(msg.decode_s) != len(msg.batches):
        raise InvalidProfile("decode_s", f"{len(msg.decode_s)} rows for {len(msg.batches)} batches: one per batch")
    for i, row in enumerate(msg.decode_s):
        if len(row) != len(msg.lengths):
            raise InvalidProfile(f"decode_s[{i}]", f"{len(row)} times for {len(msg.lengths)} lengths: one per length")
    _check_times("prefill_s", msg.prefill_s)
    for i, row in enumerate(msg.decode_s):
        _check_times(f"decode_s[{i}]", row)
    return Profile(tuple(msg.prefill_lengths), tuple(msg.prefill_s), tuple(msg.batches), tuple(msg.lengths),
                   tuple(tuple(r) for r in msg.decode_s))
