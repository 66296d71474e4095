"""The engine thread of a worker: torch work runs here, off the event loop.

The event loop submits requests and cancellations through a queue; the thread
steps every engine that has work and can run, and hands token outputs back to the
loop. An engine whose blocks are still arriving is not stepped until they have (the load
calls `wake`), so a request waiting for a block never stalls another instance's tokens;
meanwhile its waiting prefills run through the blocks already landed (Engine.prefill_ahead,
which never waits), so they are nearly done when the last block lands.
Engines are not thread-safe, so only this thread ever touches them.

Two schedules (the cluster's `sharing` setting): `turns` steps every engine with work in turn
(one model per worker in mind); `headroom` (LLM-Mesh §5.1, many models sharing the worker) runs
each iteration on the instance holding the request with the least headroom, so a model with a
burst cannot starve the others' next tokens.
"""

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Literal

from prometheus_client import Counter

from libs.engine import AdmissionError, Engine, SamplingSpec, StepShape, TokenOutput
from libs.planning.mesh import RunningRequest, most_urgent

log = logging.getLogger(__name__)

# Work dropped on a cancel (its client went away, or a hand-over): the engine freed its slots.
CANCELLED = Counter("layercast_worker_cancelled_requests_total",
                    "Requests an engine dropped unfinished on a cancel (KV slots freed)")
PREFILL_AHEAD = Counter("layercast_worker_prefill_ahead_blocks_total",
                        "Blocks of waiting prefills run while the model's later blocks were still loading")


@dataclass
class _Add:
    instance_id: str
    request_id: str
    prompt_ids: list[int]
    params: SamplingSpec
    generated_ids: list[int]
    choices: dict[int, list[int]] | None = None
    # Its SLO clock (headroom scheduling): arrival (time.monotonic()), TTFT and TPOT SLOs.
    slo: tuple[float, float, float] | None = None


@dataclass
class _Cancel:
    instance_id: str
    request_id: str


@dataclass
class _Attach:
    instance_id: str
    engine: Engine


@dataclass
class _Detach:
    instance_id: str
    done: Callable[[], None]


@dataclass
class _Call:
    """Run `fn` on the engine thread (torch work that must not race the engines: profiling)."""

    fn: Callable[[], object]
    future: Future


@dataclass
class _Wake:
    """Something an engine waited for happened (a block arrived): look again."""


IDLE_RECHECK_S = 0.25  # an engine waiting for blocks is looked at again at least this often

# (instance_id, request_id, output or None, error message or None). A request id is unique per
# instance only: a request handed over between two instances of one worker runs under the same id.
OutputSink = Callable[[list[tuple[str, str, TokenOutput | None, str | None]]], None]
# (instance_id, error): a step of that instance failed (its requests got the error)
FailureSink = Callable[[str, Exception], None]


Schedule = Literal["turns", "headroom"]


class EngineRuntime:
    def __init__(self, loop: asyncio.AbstractEventLoop, sink: OutputSink, on_failure: FailureSink | None = None,
                 schedule: Schedule = "turns"):
        if schedule not in ("turns", "headroom"):
            raise ValueError(f"schedule must be 'turns' or 'headroom', got {schedule!r}")
        self.schedule = schedule
        self._loop = loop
        self._sink = sink
        self._on_failure = on_failure
        self._inbox: queue.Queue = queue.Queue()
        self._engines: dict[str, Engine] = {}
        # (instance_id, request_id) -> its choices not finished yet
        self._running: dict[tuple[str, str], int] = {}
        # (instance_id, request_id) -> its SLO clock, O = the steps that gave it tokens (headroom)
        self._clocks: dict[tuple[str, str], RunningRequest] = {}
        # headroom: (instance, what a step computed, its seconds), for live profile refresh; bounded
        # (a consumer that stops draining loses the oldest, never the worker's memory)
        self.step_times: deque[tuple[str, StepShape, float]] | None = (
            deque(maxlen=4096) if schedule == "headroom" else None)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # --- called from the event loop --------------------------------------------------
    def attach(self, instance_id: str, engine: Engine) -> None:
        self._inbox.put(_Attach(instance_id, engine))

    async def detach(self, instance_id: str) -> None:
        done = asyncio.Event()
        self._inbox.put(_Detach(instance_id, lambda: self._loop.call_soon_threadsafe(done.set)))
        await done.wait()

    def abort_remote_stages(self, instance_id: str, reason: str) -> None:
        """From the event loop: a step of this instance waiting on another worker's stage ends now
        (with an error), so the engine thread is free for the detach and the other instances."""
        engine = self._engines.get(instance_id)
        if engine is not None:
            engine.abort_remote_stages(reason)

    def submit(self, instance_id: str, request_id: str, prompt_ids: list[int], params: SamplingSpec,
               generated_ids: list[int] = (), choices: dict[int, list[int]] | None = None,
               slo: tuple[float, float, float] | None = None) -> None:
        """`slo`: (arrival on time.monotonic(), TTFT SLO, TPOT SLO) for the headroom schedule."""
        self._inbox.put(_Add(instance_id, request_id, prompt_ids, params, list(generated_ids), choices, slo))

    def call(self, fn: Callable[[], object]) -> asyncio.Future:
        """Run `fn` on the engine thread, between steps; its result (or exception) as a future."""
        future: Future = Future()
        self._inbox.put(_Call(fn, future))
        return asyncio.wrap_future(future, loop=self._loop)

    def engine_of(self, instance_id: str) -> Engine | None:
        """The instance's attached engine: for functions run by `call` (on the engine thread) only."""
        return self._engines.get(instance_id)

    def cancel(self, instance_id: str, request_id: str) -> None:
        self._inbox.put(_Cancel(instance_id, request_id))

    def wake(self) -> None:
        """Thread-safe: an engine that waited for blocks may run now."""
        self._inbox.put(_Wake())

    def running(self, instance_id: str | None = None) -> int:
        return sum(1 for inst, _ in list(self._running) if instance_id is None or inst == instance_id)

    # --- engine thread -----------------------------------------------------------------------
    def _emit(self, batch: list) -> None:
        if batch:
            self._loop.call_soon_threadsafe(self._sink, batch)

    def _apply(self, cmd: object, out: list) -> None:
        if isinstance(cmd, _Attach):
            self._engines[cmd.instance_id] = cmd.engine
        elif isinstance(cmd, _Detach):
            engine = self._engines.pop(cmd.instance_id, None)
            for inst, rid in list(self._running):
                if inst == cmd.instance_id:
                    if engine is not None:
                        engine.cancel(rid)
                    self._running.pop((inst, rid), None)
                    self._clocks.pop((inst, rid), None)
                    out.append((inst, rid, None, "instance stopped"))
            cmd.done()
        elif isinstance(cmd, _Add):
            engine = self._engines.get(cmd.instance_id)
            if engine is None:
                out.append((cmd.instance_id, cmd.request_id, None, f"instance {cmd.instance_id} is not on this worker"))
                return
            try:
                engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, generated_ids=cmd.generated_ids,
                                   choices=cmd.choices)
                self._running[(cmd.instance_id, cmd.request_id)] = len(cmd.choices or range(cmd.params.n))
                if cmd.slo is not None:
                    start, ttft, tpot = cmd.slo
                    done = min((len(ids) for ids in (cmd.choices or {0: cmd.generated_ids}).values()), default=0)
                    self._clocks[(cmd.instance_id, cmd.request_id)] = RunningRequest(
                        cmd.request_id, start, len(cmd.prompt_ids), done, ttft, tpot)
            except (AdmissionError, ValueError) as e:
                out.append((cmd.instance_id, cmd.request_id, None, str(e)))
        elif isinstance(cmd, _Call):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    cmd.future.set_exception(e)
        elif isinstance(cmd, _Cancel):
            key = (cmd.instance_id, cmd.request_id)
            self._clocks.pop(key, None)
            if key in self._running:
                del self._running[key]
                if cmd.instance_id in self._engines and self._engines[cmd.instance_id].cancel(cmd.request_id):
                    CANCELLED.inc()

    def _run(self) -> None:
        ahead = False  # the last round ran a prefill ahead of a load: there may be more to run at once
        while not self._stopping:
            pending = [e for e in self._engines.values() if e.has_work()]
            busy = ahead or any(e.runnable() for e in pending)
            out: list = []
            try:
                # Block only when idle (bounded while an engine waits for blocks); otherwise drain
                # what arrived and keep stepping.
                cmd = (self._inbox.get_nowait() if busy
                       else self._inbox.get(timeout=IDLE_RECHECK_S if pending else None))
                if cmd is None:
                    break
                self._apply(cmd, out)
                while True:
                    cmd = self._inbox.get_nowait()
                    if cmd is None:
                        self._stopping = True
                        break
                    self._apply(cmd, out)
            except queue.Empty:
                pass
            for instance_id in self._to_step():
                self._step(instance_id, self._engines[instance_id], out)
            ahead = False
            for engine in self._engines.values():
                if engine.has_work() and not engine.runnable():
                    before = engine.ahead_blocks
                    if engine.prefill_ahead():  # one pass through the blocks landed: never waits for one
                        ahead = True
                        PREFILL_AHEAD.inc(engine.ahead_blocks - before)
            self._emit(out)

    def _to_step(self) -> list[str]:
        """The engines this round steps: every one that can (turns), or the one holding the most
        urgent request (headroom; an engine with work but no clock, e.g. a hand-over's leftovers,
        when none has)."""
        ready = [i for i, e in self._engines.items() if e.has_work() and e.runnable()]
        if self.schedule == "turns" or len(ready) < 2:
            return ready
        by_instance: dict[str, list[RunningRequest]] = {i: [] for i in ready}
        for (inst, _), clock in self._clocks.items():
            if inst in by_instance:
                by_instance[inst].append(clock)
        chosen = most_urgent(by_instance, time.monotonic())
        return [chosen if chosen is not None else ready[0]]

    def _step(self, instance_id: str, engine: Engine, out: list) -> None:
        try:
            stepped: set[str] = set()
            started = time.perf_counter()
            outputs = engine.step()
            if self.step_times is not None and engine.last_step is not None:
                self.step_times.append((instance_id, engine.last_step, time.perf_counter() - started))
            for o in outputs:
                key = (instance_id, o.request_id)
                if key not in self._running:
                    continue  # cancelled while this step ran
                out.append((instance_id, o.request_id, o, None))
                stepped.add(o.request_id)
                if o.finished:  # a choice ended; the request, once all have
                    self._running[key] -= 1
                    if not self._running[key]:
                        del self._running[key]
                        self._clocks.pop(key, None)
            for rid in stepped:  # O: one more token for each request this iteration served
                clock = self._clocks.get((instance_id, rid))
                if clock is not None:
                    self._clocks[(instance_id, rid)] = replace(clock, generated=clock.generated + 1)
        except Exception as e:  # a failing step fails its requests, not the worker
            log.exception("engine step failed on %s", instance_id)
            for inst, rid in list(self._running):
                if inst == instance_id:
                    engine.cancel(rid)
                    del self._running[(inst, rid)]
                    self._clocks.pop((inst, rid), None)
                    out.append((inst, rid, None, f"engine error: {e}"))
            if self._on_failure is not None:
                self._loop.call_soon_threadsafe(self._on_failure, instance_id, e)
