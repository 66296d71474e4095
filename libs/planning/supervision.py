"""When the launcher's supervisor restarts a service that died: capped exponential backoff, as
Kubernetes restarts a crashed container (10 s doubling to 5 min there; shorter by default here,
a dev cluster on one machine).

``restart_delay(run_s, previous_delay_s, policy)``: a process that died after running
``run_s`` seconds is started again after the returned delay. A process that ran at least
``policy.stable_s`` is restarted after ``policy.initial_s`` (its crash is a new incident);
one that died sooner waits twice as long as the last time, at most ``policy.max_s``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartBackoff:
    initial_s: float = 0.2
    max_s: float = 10.0
    factor: float = 2.0
    stable_s: float = 30.0  # a run this long resets the backoff

    def __post_init__(self):
        if not (0 <= self.initial_s <= self.max_s):
            raise ValueError(f"need 0 <= initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1, got {self.factor}")
        if self.stable_s < 0:
            raise ValueError(f"stable_s must be >= 0, got {self.stable_s}")


def restart_delay(run_s: float, previous_delay_s: float | None, policy: RestartBackoff = RestartBackoff()) -> float:
    """Seconds to wait before starting again a process that died after running `run_s`
    seconds; `previous_delay_s` is the delay before its last start (None: never restarted)."""
    if previous_delay_s is None or run_s >= policy.stable_s:
        return policy.initial_s
    return min(policy.max_s, max(policy.initial_s, previous_delay_s * policy.factor))
