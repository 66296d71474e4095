"""Supervision of a launched cluster, as Kubernetes restarts a crashed container: a process
that exits is started again the way the launcher started it (libs.cluster.launcher.launch_process),
after a capped exponential backoff (libs.planning.supervision), and the restart is logged.

A worker's exit is also told to the registry at once (RPC REGISTRY_WORKER_EXITED): its
instances stop and the gateway moves their requests now, not when its heartbeats expire.

`layercast up` runs one in the foreground; tests run one in a thread (`start()` / `stop()`)
and kill processes with launcher.kill_process, letting it restart them.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from libs.cluster.launcher import ClusterState, ProcessInfo, exit_status, launch_process, process_alive
from libs.planning.supervision import RestartBackoff, restart_delay

log = logging.getLogger(__name__)


@dataclass
class SupervisionEvent:
    """An exit seen or a restart made, in the order they happened (what tests assert on)."""

    kind: str  # "exited" | "told_registry" (a worker's; detail: "dead", "already dead", "failed: ...")
    #           | "restarted" | "restart_failed"
    name: str
    pid: int
    at: float  # time.monotonic()
    detail: str = ""


@dataclass
class _Watch:
    started_at: float
    last_delay: float | None = None
    restart_at: float | None = None  # set while it is dead and waits for its restart
    dead_pid: int | None = None


def worker_id_of(p: ProcessInfo) -> str | None:
    """The worker id a worker process was started with (None for the other services)."""
    if "--worker-id" in p.argv:
        i = p.argv.index("--worker-id")
        return p.argv[i + 1] if i + 1 < len(p.argv) else None
    return None


def report_worker_exit(state: ClusterState, worker_id: str, reason: str, timeout_s: float = 2.0) -> bool:
    """Tell the cluster's registry that `worker_id`'s process exited; whether it declared it dead."""
    from libs.bus.broker import call, make_broker, start_broker
    from libs.protocol import messages as m
    from libs.protocol import subjects

    async def tell() -> bool:
        broker = make_broker(state.nats_url)
        await start_broker(broker)
        try:
            ack = await call(broker, subjects.in_namespace(subjects.REGISTRY_WORKER_EXITED, state.namespace),
                             m.WorkerExited(worker_id=worker_id, reason=reason), m.CommandAck, timeout=timeout_s)
            return ack.accepted
        finally:
            await broker.stop()

    async def bounded() -> bool:  # NATS down: the connection attempts are cut off too
        return await asyncio.wait_for(tell(), timeout_s + 2)
    return asyncio.run(bounded())


class Supervisor:
    def __init__(self, state: ClusterState, emulation=None, backoff: RestartBackoff = RestartBackoff(),
                 report: Callable[[str], None] | None = None, poll_s: float = 0.1, tell_registry: bool = True):
        self.state, self.emulation, self.backoff, self.poll_s = state, emulation, backoff, poll_s
        self.report = report or log.warning
        self.tell_registry = tell_registry
        self.events: list[SupervisionEvent] = []
        self._watch = {p.name: _Watch(time.monotonic()) for p in state.processes}
        self._stop = threading.Event()
        self._stop_requested = False  # request_stop()'s: a plain flag, safe to set from a signal handler
        self._thread: threading.Thread | None = None

    def _event(self, kind: str, p: ProcessInfo, pid: int, detail: str = "") -> None:
        self.events.append(SupervisionEvent(kind, p.name, pid, time.monotonic(), detail))

    def check(self) -> list[str]:
        """One pass: note the processes that exited, start those whose backoff has passed. Returns
        the names restarted."""
        restarted = []
        now = time.monotonic()
        for p in list(self.state.processes):
            if self.stopping:
                break  # the cluster is being stopped: exits are its doing
            w = self._watch.setdefault(p.name, _Watch(now))
            if w.restart_at is None:
                if process_alive(p.pid):
                    continue
                code = exit_status(p.pid)
                w.dead_pid = p.pid
                delay = restart_delay(now - w.started_at, w.last_delay, self.backoff)
                w.last_delay, w.restart_at = delay, now + delay
                how = "exit code unknown" if code is None else (f"killed by signal {-code}" if code < 0
                                                                else f"exit code {code}")
                self._event("exited", p, p.pid, how)
                self.report(f"{p.name} (pid {p.pid}) exited ({how}); restarting it in {delay:.1f}s "
                            f"(restart {p.restarts + 1})")
                wid = worker_id_of(p)
                if wid is not None and self.tell_registry:
                    try:
                        told = "dead" if report_worker_exit(self.state, wid, how) else "already dead"
                    except Exception as e:  # NATS or the registry down: its heartbeats will expire
                        told = f"failed: {e!r}"
                    self._event("told_registry", p, p.pid, told)
                    self.report(f"registry told that {wid} exited: {told}")
                now = time.monotonic()
            if now < w.restart_at or self.stopping:
                continue  # not yet; or the cluster is being stopped: it stays down
            if p.pid != w.dead_pid and process_alive(p.pid):  # someone restarted it meanwhile
                w.restart_at, w.started_at = None, now
                continue
            try:
                proc = launch_process(p, self.emulation)
            except Exception as e:
                w.restart_at = now + w.last_delay
                self._event("restart_failed", p, p.pid, repr(e))
                self.report(f"{p.name}: restart failed: {e!r}")
                continue
            old, p.pid, p.restarts = p.pid, proc.pid, p.restarts + 1
            w.restart_at, w.started_at = None, time.monotonic()
            self._event("restarted", p, proc.pid, f"was pid {old}")
            self.report(f"{p.name} restarted (pid {proc.pid}, restart {p.restarts})")
            restarted.append(p.name)
            try:
                self.state.save()  # `layercast status` and `down` see the new pid
            except OSError as e:
                self.report(f"could not save the cluster state: {e!r}")
        return restarted

    def run(self) -> None:
        """Check every poll_s until stop() or request_stop(); a pass under way ends first (a
        restart it makes is recorded in the state, which the shutdown then stops)."""
        while not self.stopping:
            try:
                self.check()
            except Exception:  # never let one bad pass end supervision
                log.exception("supervision pass failed")
            if not self.stopping:
                self._stop.wait(self.poll_s)

    @property
    def stopping(self) -> bool:
        return self._stop_requested or self._stop.is_set()

    def request_stop(self) -> None:
        """Stop restarting: run() returns within a poll. Safe in a signal handler (no lock: an
        Event's set() there could wait for the lock its own thread holds in wait())."""
        self._stop_requested = True

    def start(self) -> "Supervisor":
        self._stop.clear()
        self._stop_requested = False
        self._thread = threading.Thread(target=self.run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
