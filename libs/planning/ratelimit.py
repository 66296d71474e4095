"""Per-key rate limits (requests and tokens per minute) as a pure function.

``admit(limits, window, now, tokens) -> (Decision, Window)``: the gateway keeps one
:class:`Window` per API key and asks before dispatching a request; ``settle`` replaces a
request's token estimate (prompt + ``max_tokens``, counted at admission as the OpenAI API
does) by what it really used once its usage is known.

The window is a sliding log of the admissions of the last ``window_s`` seconds, not a token
bucket: a bucket admits up to twice its size across one minute (a full bucket, then its
refill), a log never admits more than the limit within any ``window_s`` interval. It holds at
most ``requests_per_minute`` entries (or one per request of the last minute without one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["Decision", "Limits", "Window", "admit", "format_reset", "settle"]


@dataclass(frozen=True)
class Limits:
    """None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    window_s: float = 60.0

    @property
    def unlimited(self) -> bool:
        return self.requests_per_minute is None and self.tokens_per_minute is None


@dataclass(frozen=True)
class Window:
    """Admissions still counted: (time admitted, tokens), oldest first."""

    entries: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Decision:
    admitted: bool
    # Which limit refused it; `too_large`: the request alone asks for more tokens than the
    # limit, so no wait admits it.
    refused_by: Literal["requests", "tokens"] | None = None
    too_large: bool = False
    retry_after_s: float = 0.0  # > 0 when refused: the wait after which it would be admitted
    # What the x-ratelimit-* headers say, after this decision. reset: until the window is empty.
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float = 0.0
    reset_tokens_s: float = 0.0


def _live(window: Window, limits: Limits, now: float) -> tuple[tuple[float, int], ...]:
    # An entry admitted at t counts while now < t + window_s.
    return tuple(e for e in window.entries if e[0] + limits.window_s > now)


def _expiry_wait(entries: tuple[tuple[float, int], ...], limits: Limits, now: float, i: int) -> float:
    """Seconds until entries[i] (and every older one) stops counting; > 0 for a live entry."""
    return entries[i][0] + limits.window_s - now


def admit(limits: Limits, window: Window, now: float, tokens: int = 0) -> tuple[Decision, Window]:
    """Admit one request that may use `tokens` tokens at `now` (times never go backwards)."""
    live = _live(window, limits, now)
    used = sum(t for _, t in live)
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    # Each limit's wait until it would admit the request (0: now); the request waits for both.
    wait_requests = wait_tokens = 0.0
    if rpm is not None and len(live) >= rpm:
        # Admitted once all but rpm - 1 of the live entries expired.
        wait_requests = _expiry_wait(live, limits, now, len(live) - rpm)
    too_large = tpm is not None and tokens > tpm
    if too_large:
        wait_tokens = limits.window_s
    elif tpm is not None and used + tokens > tpm:
        freed = 0
        for i, (_, t) in enumerate(live):  # the oldest entries whose expiry frees enough tokens
            freed += t
            if used - freed + tokens <= tpm:
                wait_tokens = _expiry_wait(live, limits, now, i)
                break
    refused_by = "requests" if wait_requests > 0 else "tokens" if wait_tokens > 0 else None
    wait = max(wait_requests, wait_tokens)
    if refused_by is None:
        live = (*live, (now, tokens))
        used += tokens
    reset = _expiry_wait(live, limits, now, len(live) - 1) if live else 0.0
    decision = Decision(
        admitted=refused_by is None, refused_by=refused_by, too_large=too_large, retry_after_s=wait,
        remaining_requests=None if rpm is None else max(0, rpm - len(live)),
        remaining_tokens=None if tpm is None else max(0, tpm - used),
        reset_requests_s=reset, reset_tokens_s=reset)
    return decision, Window(live)


def settle(window: Window, admitted_at: float, estimated: int, used: int) -> Window:
    """Count `used` tokens instead of the estimate for the request admitted at `admitted_at`
    (an entry gone from the window has nothing left to correct)."""
    entries = list(window.entries)
    for i, e in enumerate(entries):
        if e == (admitted_at, estimated):
            entries[i] = (admitted_at, max(0, used))
            return replace(window, entries=tuple(entries))
    return window


def format_reset(seconds: float) -> str:
    """A duration as the OpenAI API writes its x-ratelimit-reset-* headers: "20ms", "1.5s", "6m0s"."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
