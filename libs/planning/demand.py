"""What the gateways report, turned into one metrics sample per model per tick.

Each gateway reports, per model, every ``metrics_interval_s`` or sooner on
demand (``GatewayMetrics`` / ``ModelLoad``): levels (requests queued and in
flight, the output tokens the queued requests asked for) and deltas since its
previous report (completion tokens streamed, TTFT and TPOT observations).

Demand in tokens/s (``MetricsSample.load_tps``), per model, summed over the
gateways, is BlitzScale §5.3's "serving load in tokens per second" plus the
work waiting for an instance:

    load_tps = tokens_generated / interval_s  +  queued_tokens / drain_s

* the served rate: completion tokens streamed over the report's interval
  (the gateway's own clock), a level that holds until its next report;
* the backlog: the output tokens (``max_tokens`` × ``n``) of the requests
  waiting at the gateway for an instance slot, to be served within
  ``drain_s``.  It is what makes demand visible where nothing is served yet:
  requests waiting for a model with no instance give a positive load, so the
  threshold policy scales from zero.  An overloaded instance shows both: its
  served rate at its capacity and a queue that grows.

Output tokens only: ``capacity_tps`` (the threshold policy's profiled
capacity) is in the same unit.  Latency observations are deltas: each
reaches exactly one tick's sample (:meth:`GatewayReports.take` drains them),
whether reports arrive faster or slower than ticks.  A gateway that stops
reporting for ``stale_s`` counts no more (its levels would otherwise hold
demand up forever).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["GatewayReports", "ModelDemand", "ModelReport"]


@dataclass(frozen=True)
class ModelReport:
    """One gateway's report on one model (a ModelLoad, as plain values)."""

    queued: int = 0
    in_flight: int = 0
    tokens_generated: int = 0  # since the gateway's previous report
    queued_tokens: int = 0  # output tokens the queued requests asked for (a level)
    interval_s: float | None = None  # the time the deltas cover (None: unknown, no rate)
    last_request_at: float | None = None
    ttft_s: tuple[float, ...] = ()
    tpot_s: tuple[float, ...] = ()

    def load_tps(self, drain_s: float) -> float:
        served = self.tokens_generated / self.interval_s if self.interval_s else 0.0
        return served + self.queued_tokens / drain_s


@dataclass(frozen=True)
class ModelDemand:
    """One tick's demand for one model, over every live gateway."""

    requests: int = 0  # queued plus in flight
    load_tps: float = 0.0
    ttft_s: tuple[float, ...] = ()
    tpot_s: tuple[float, ...] = ()
    last_requests: tuple[float, ...] = ()


@dataclass
class GatewayReports:
    """The latest report of every gateway, and the latency samples no tick has taken yet."""

    drain_s: float = 1.0  # queued work counts as demand to serve within this long
    stale_s: float = 5.0  # a gateway silent this long is gone
    _latest: dict[str, tuple[float, dict[str, ModelReport]]] = field(default_factory=dict)
    _pending: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.drain_s <= 0 or self.stale_s <= 0:
            raise ValueError("drain_s and stale_s must be > 0")

    def add(self, gateway_id: str, received_at: float, models: Iterable[tuple[str, ModelReport]]) -> None:
        reports = dict(models)
        self._latest[gateway_id] = (received_at, reports)
        for name, r in reports.items():
            ttft, tpot = self._pending.setdefault(name, ([], []))
            ttft.extend(r.ttft_s)
            tpot.extend(r.tpot_s)

    def live(self, now: float) -> list[dict[str, ModelReport]]:
        for gw in [g for g, (at, _) in self._latest.items() if now - at > self.stale_s]:
            del self._latest[gw]
        return [reports for _, reports in self._latest.values()]

    def take(self, model: str, now: float) -> ModelDemand:
        """This tick's demand for `model`; the latency samples it returns are no one else's."""
        reports = [g[model] for g in self.live(now) if model in g]
        ttft, tpot = self._pending.pop(model, ((), ()))
        return ModelDemand(requests=sum(r.queued + r.in_flight for r in reports),
                           load_tps=sum(r.load_tps(self.drain_s) for r in reports),
                           ttft_s=tuple(ttft), tpot_s=tuple(tpot),
                           last_requests=tuple(r.last_request_at for r in reports if r.last_request_at is not None))

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the pending samples of models no longer deployed."""
        keep = set(keep)
        for name in [n for n in self._pending if n not in keep]:
            del self._pending[name]
