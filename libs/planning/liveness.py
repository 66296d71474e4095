"""When a worker that a peer could not reach on the data plane is dead (issue 40).

A worker's heartbeats stop a TTL after it dies; its data-plane peers (pipeline stages, live
pairs, multicast senders and receivers) see their connection to it break at once. A peer
then reports it (WorkerUnreachable); the registry does not take one peer's word for it (a
peer's own link may be what broke, or a report may be false), and checks for itself:

- it connects to the worker's data-plane address (the one the worker registered). The
  worker's host answering with a refusal means nothing listens there: the process is gone,
  dead. A connection taken means the process (its listening socket) is alive, whatever the
  reports say: a hung worker is the heartbeat TTL's to find, not this rule's.
- when the connect cannot tell (no answer in time: a dead host or a cut link look the same;
  or an address no connect can test, such as rdma's), reports from `quorum` distinct
  peers within `window_s` make the death.

``add_report(reports, report, now, rule)`` keeps the reports that count; ``verdict(worker,
reports, probe, now, rule)`` decides. Pure: the registry probes and carries the verdict out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Probe(StrEnum):
    """What a connect to the worker's data-plane address found."""

    refused = "refused"  # its host answered: nothing listens there
    accepted = "accepted"  # a connection was taken: the process lives
    silent = "silent"  # no answer in time, or the host or network unreachable: cannot tell
    untestable = "untestable"  # no address a connect can test (rdma): the reports alone decide


@dataclass(frozen=True)
class LivenessRule:
    quorum: int = 2  # distinct reporters that make a death when the probe cannot tell
    window_s: float = 10.0  # how long a report counts

    def __post_init__(self):
        if self.quorum < 1:
            raise ValueError(f"quorum must be >= 1, got {self.quorum}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


@dataclass(frozen=True)
class Report:
    reporter: str
    at: float


@dataclass(frozen=True)
class Verdict:
    dead: bool
    why: str


def probe_target(data_address: str) -> tuple[str, int] | None:
    """(host, port) a TCP connect can test for a registered data-plane address; None for one
    it cannot (rdma://..., or not host:port)."""
    host, sep, port = data_address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def add_report(reports: tuple[Report, ...], worker_id: str, report: Report, now: float,
               rule: LivenessRule = LivenessRule()) -> tuple[Report, ...]:
    """`reports` about `worker_id` with `report` added: those older than the window dropped,
    one per reporter (its latest), none by the worker about itself."""
    kept = {r.reporter: r for r in reports if now - r.at <= rule.window_s}
    if report.reporter != worker_id and now - report.at <= rule.window_s:
        if report.reporter not in kept or kept[report.reporter].at <= report.at:
            kept[report.reporter] = report
    return tuple(sorted(kept.values(), key=lambda r: (r.at, r.reporter)))


def verdict(worker_id: str, reports: tuple[Report, ...], probe: Probe, now: float,
            rule: LivenessRule = LivenessRule()) -> Verdict:
    """Whether `worker_id` is dead, from the reports about it and the registry's own probe."""
    if probe is Probe.accepted:
        return Verdict(False, "its data plane took a connection: alive")
    if probe is Probe.refused:
        return Verdict(True, "connection refused at its data-plane address: nothing listens there")
    reporters = {r.reporter for r in reports if r.reporter != worker_id and now - r.at <= rule.window_s}
    if len(reporters) >= rule.quorum:
        return Verdict(True, f"unreachable from {len(reporters)} peers ({', '.join(sorted(reporters))}) "
                             f"within {rule.window_s:g} s, and its data-plane address {probe.value}")
    return Verdict(False, f"{len(reporters)} of {rule.quorum} peers report it unreachable and its "
                          f"data-plane address is {probe.value}: not taken for dead (yet)")
