"""The engine thread of a worker: torch work runs here, off the event loop.

The event loop submits requests and cancellations through a queue; the thread
steps every engine that has work and hands token outputs back to the loop.
Engines are not thread-safe, so only this thread ever touches them.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from libs.engine import AdmissionError, Engine, SamplingParams, TokenOutput

log = logging.getLogger(__name__)


@dataclass
class _Add:
    instance_id: str
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generated_ids: list[int]


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Attach:
    instance_id: str
    engine: Engine


@dataclass
class _Detach:
    instance_id: str
    done: Callable[[], None]


# (request_id, output or None, error message or None)
OutputSink = Callable[[list[tuple[str, TokenOutput | None, str | None]]], None]


class EngineRuntime:
    def __init__(self, loop: asyncio.AbstractEventLoop, sink: OutputSink):
        self._loop = loop
        self._sink = sink
        self._inbox: queue.Queue = queue.Queue()
        self._engines: dict[str, Engine] = {}
        self._owner: dict[str, str] = {}  # request_id -> instance_id
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

    def submit(self, instance_id: str, request_id: str, prompt_ids: list[int], params: SamplingParams,
               generated_ids: list[int] = ()) -> None:
        self._inbox.put(_Add(instance_id, request_id, prompt_ids, params, list(generated_ids)))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id))

    def running(self, instance_id: str | None = None) -> int:
        return sum(1 for inst in list(self._owner.values()) if instance_id is None or inst == instance_id)

    # --- engine thread -----------------------------------------------------------------------
    def _emit(self, batch: list) -> None:
        if batch:
            self._loop.call_soon_threadsafe(self._sink, batch)

    def _apply(self, cmd: object, out: list) -> None:
        if isinstance(cmd, _Attach):
            self._engines[cmd.instance_id] = cmd.engine
        elif isinstance(cmd, _Detach):
            engine = self._engines.pop(cmd.instance_id, None)
            for rid, inst in list(self._owner.items()):
                if inst == cmd.instance_id:
                    if engine is not None:
                        engine.cancel(rid)
                    del self._owner[rid]
                    out.append((rid, None, "instance stopped"))
            cmd.done()
        elif isinstance(cmd, _Add):
            engine = self._engines.get(cmd.instance_id)
            if engine is None:
                out.append((cmd.request_id, None, f"instance {cmd.instance_id} is not on this worker"))
                return
            try:
                engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, generated_ids=cmd.generated_ids)
                self._owner[cmd.request_id] = cmd.instance_id
            except (AdmissionError, ValueError) as e:
                out.append((cmd.request_id, None, str(e)))
        elif isinstance(cmd, _Cancel):
            inst = self._owner.pop(cmd.request_id, None)
            if inst is not None and inst in self._engines:
                self._engines[inst].cancel(cmd.request_id)

    def _run(self) -> None:
        while not self._stopping:
            busy = any(e.has_work() for e in self._engines.values())
            out: list = []
            try:
                # Block only when idle; otherwise drain what arrived and keep stepping.
                cmd = self._inbox.get_nowait() if busy else self._inbox.get()
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
            for instance_id, engine in list(self._engines.items()):
                if not engine.has_work():
                    continue
                try:
                    for o in engine.step():
                        if o.request_id not in self._owner:
                            continue  # cancelled while this step ran
                        out.append((o.request_id, o, None))
                        if o.finished:
                            del self._owner[o.request_id]
                except Exception as e:  # a failing step fails its requests, not the worker
                    log.exception("engine step failed on %s", instance_id)
                    for rid, inst in list(self._owner.items()):
                        if inst == instance_id:
                            engine.cancel(rid)
                            del self._owner[rid]
                            out.append((rid, None, f"engine error: {e}"))
            self._emit(out)
