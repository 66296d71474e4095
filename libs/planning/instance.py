"""A worker's instance lifecycle as a pure state machine.

``step(lifecycle, event) -> (lifecycle, effects)``: the worker feeds what it observes about
one instance (a LoadModel, a block in host memory or in engine memory, a disk read started
or done, the engine built, the load's end, an unload, a drain's deadline, a pipeline stage
lost, a request admitted or ended) and carries out the effects it gets back (pin a block, read
blocks from disk, cancel a read, attach the engine, report the instance loaded or stopped,
release its pins, answer a request's admission, ...). No I/O.

Phases (``Phase``)::

    absent ──LoadAsked──▶ loading ──engine built, a block in──▶ serving_while_loading
       │                    │  └──every block in, engine built──▶ serving ◀──────┘ (every block in)
       │                    └──UnloadAsked──▶ cancelling ──LoadFailed──▶ stopped
       ├──PipelineStarted(entry)──▶ serving (kind pipeline)
       └──PipelineStarted(stage)──▶ stage ──UnloadAsked──▶ stopped
    serving / serving_while_loading ──UnloadAsked / StagePeerLost──▶ draining ──Drained──▶ stopped / failed
    loading / serving_while_loading / serving ──LoadFailed──▶ failed

Live pairs (BlitzScale §5.2): an overloaded instance (the source, every block in) and an instance
still loading the same model (the target) pair on the planner's word::

    serving ──PairFormed(source)──▶ pair_source ──PairEnded──▶ serving
    loading ──PairFormed(target)──▶ pair_target ──every block in, engine built──▶ serving (the pair dissolves)
                                        └──PairEnded──▶ loading
    pair_source ──UnloadAsked──▶ draining;  pair_target ──UnloadAsked──▶ cancelling, ──LoadFailed──▶ failed
    pair_source / pair_target ──PairLost (the other side failing)──▶ serving / loading

The source serves as before and offloads the first layers of some prefills to the target
(the split per batch: ZigZag); the target runs them on the blocks it already holds and
hands the hidden state and those layers' KV back, so nothing of a request stays on the
target. Whichever side ends the pair tells the other (``EndPair(notify_peer=True)``); the
side told gets ``PairEnded`` and only stops its own part. A target never serves early: it
attaches once every block is in, right after the pair dissolves (the paper's step 3).

Requests: the lifecycle keeps the ids of the requests running on it. ``RequestAdmitted`` is
accepted only while it serves (serving, serving_while_loading, a pipeline's entry), refused
in every other phase (``Refuse(code="unavailable")``); ``RequestEnded`` removes one. A drain
ends as soon as its last request ends (``RequestEnded`` then has the ``Drained`` transition's
effects), or at its deadline (the worker feeds ``Drained``); a drain with no request running
ends at once (the worker feeds ``Drained`` without waiting).

The races the worker used to handle case by case are transitions here: an unload while the
load is still reading (its reads are cancelled at once, a read that starts afterwards is
cancelled as it starts, the load ends at its next step and reports ``stopped``, not
``failed``); an unload of an instance serving while it loads (it drains while the load
ends; the stop is reported once); a block that lands after the unload (not pinned, not
announced); a LoadModel sent again (answered, never a second load nor a second "loaded").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

__all__ = [
    "Answer", "AnnounceBlock", "EndPair", "PairEnded", "PairFormed", "PairLost", "StartPair", "Attach", "BlockInEngine", "BlockInHost", "CancelRead", "Detach",
    "DiskNeeded", "DiskReadDone", "DiskReadStarted", "Drain", "Drained", "Effect", "EndLoad", "EngineBuilt",
    "Event", "EvictFromEngine", "Lifecycle", "LoadAsked", "LoadFailed", "LoadFinished", "Phase", "Pin",
    "PipelineStarted", "ReadFromDisk", "ReannounceLoaded", "Refuse", "ReleasePins", "ReportLoaded",
    "ReportStopped", "RequestAdmitted", "RequestEnded", "StagePeerLost", "StartLoad", "StopHosting",
    "UnloadAsked", "step",
]


class Phase(StrEnum):
    absent = "absent"  # nothing of it here (never stored: the worker forgets ended instances)
    loading = "loading"  # blocks arriving, no engine attached yet
    serving_while_loading = "serving_while_loading"  # attached from an early block; the rest still arriving
    serving = "serving"  # every block in engine memory (a pipeline's entry: from its start)
    stage = "stage"  # hosts a later stage of another worker's execution pipeline
    cancelling = "cancelling"  # unloaded before it attached: its load ends at its next step
    draining = "draining"  # unloaded while serving: no new requests, running ones finish
    pair_source = "pair_source"  # serving, and offloading the first layers of prefills to a loading peer
    pair_target = "pair_target"  # loading, and running the first layers of a serving peer's prefills
    stopped = "stopped"
    failed = "failed"


SERVING = frozenset({Phase.serving_while_loading, Phase.serving, Phase.pair_source})
LOADING = frozenset({Phase.loading, Phase.serving_while_loading, Phase.pair_target})  # the load goes on
STOPPING = frozenset({Phase.cancelling, Phase.draining})  # an unload was asked, the stop not reported
ENDED = frozenset({Phase.stopped, Phase.failed})
PAIRED_PHASES = frozenset({Phase.pair_source, Phase.pair_target})

NOT_HERE = "not here"  # Answer.detail of an unload of an instance this worker does not have
UNLOADED_WHILE_LOADING = "unloaded by planner while loading"
LOAD_ENDED_EARLY = "the load ended before every block was in engine memory"
NOT_SERVING = "not serving"  # Refuse.detail of a request for an instance that takes none
ADMITTED = "admitted"  # Answer.detail of a request admitted
PAIRED = "paired"  # Answer.detail of a pair formed
PAIR_DISSOLVED = "dissolved: the target holds every block"  # EndPair.reason at the target's last block
NOT_PAIRABLE = "cannot pair"  # Refuse.detail of a PairFormed in a phase that cannot pair


@dataclass(frozen=True)
class Lifecycle:
    """One instance on this worker, as far as its lifecycle goes."""

    instance_id: str
    phase: Phase = Phase.absent
    kind: Literal["local", "pipeline", "stage"] = "local"
    blocks: frozenset[int] = frozenset()  # what its load brings into engine memory
    in_engine: frozenset[int] = frozenset()  # announced in engine memory
    pins: frozenset[int] = frozenset()  # host-tier blocks pinned for it (released when it stops)
    disk_jobs: frozenset[int] = frozenset()  # disk reads issued and neither done nor cancelled
    jobs_issued: int = 0  # disk-read ids handed out so far (the next is jobs_issued + 1)
    serve_early: bool = True  # attach once the engine is built and a block is in
    engine_built: bool = False
    attached: bool = False  # its engine takes requests (the worker's `instances` holds it)
    loaded_reported: bool = False
    load_running: bool = False  # its load task has not ended yet
    ends_as: Phase = Phase.stopped  # while stopping: what it will be
    reason: str = ""  # why it stops
    switched_to: tuple[str, ...] = ()
    keep_alive_s: float | None = None  # its host blocks' keep-alive after the stop (None: kept)
    requests: frozenset[str] = frozenset()  # requests admitted and not ended (a drain waits for them)
    pair_peer: str = ""  # the other instance of its live pair (pair_source / pair_target)

    @property
    def serving(self) -> bool:
        """Takes new requests."""
        return self.phase in SERVING

    @property
    def forgettable(self) -> bool:
        """Ended, and nothing of it runs any more: the worker may drop it (a new LoadModel of
        the same id is a fresh load)."""
        return self.phase in ENDED and not self.load_running


# --- events: what the worker observes -----------------------------------------------------------


@dataclass(frozen=True)
class LoadAsked:
    """A LoadModel of blocks [start, end). `readable`: its checkpoint path is there."""

    blocks: tuple[int, ...]
    serve_while_loading: bool = True
    readable: bool = True


@dataclass(frozen=True)
class PipelineStarted:
    """A StartPipeline made this worker the pipeline's entry (an attached engine) or a later stage."""

    entry: bool


@dataclass(frozen=True)
class BlockInHost:
    """A block of the load is in the host tier (held there, a transfer brought it, a disk read
    is about to put it there): to be pinned while the instance uses it."""

    block: int


@dataclass(frozen=True)
class DiskNeeded:
    """The load reads these blocks from disk (neither in the host tier nor brought by a transfer,
    or a transfer ended without them)."""

    blocks: tuple[int, ...]


@dataclass(frozen=True)
class DiskReadStarted:
    job: int


@dataclass(frozen=True)
class DiskReadDone:
    job: int


@dataclass(frozen=True)
class BlockInEngine:
    """A block verified and in engine memory."""

    block: int


@dataclass(frozen=True)
class EngineBuilt:
    pass


@dataclass(frozen=True)
class LoadFinished:
    """The load task ended after its last block."""


@dataclass(frozen=True)
class LoadFailed:
    """The load task raised: a failure, or its own end after an unload (EndLoad, a cancelled read)."""

    error: str


@dataclass(frozen=True)
class UnloadAsked:
    reason: str = "unloaded by planner"
    switched_to: tuple[str, ...] = ()
    drain_timeout_s: float = 0.0
    keep_alive_s: float | None = None


@dataclass(frozen=True)
class Drained:
    """The drain's deadline passed, or it had no request to wait for (a drain whose last request
    ended is over at that RequestEnded already)."""


@dataclass(frozen=True)
class StagePeerLost:
    """A step of a pipeline's engine failed: a stage elsewhere is gone (its worker died, its link broke)."""

    error: str


@dataclass(frozen=True)
class RequestAdmitted:
    """A generate request for the instance, admitted by the worker's sharing strategy: it runs
    on the instance if the instance serves (answered), else it is refused."""

    request_id: str


@dataclass(frozen=True)
class RequestEnded:
    """A request of the instance ended, whichever way (finished, failed, cancelled, preempted,
    handed over to another instance, its engine detached)."""

    request_id: str


@dataclass(frozen=True)
class PairFormed:
    """The planner paired this instance with `peer` (worker/instance) for a live pair: as its
    `source` (serving every block, overloaded) or its `target` (loading the same model)."""

    role: Literal["source", "target"]
    peer: str


@dataclass(frozen=True)
class PairEnded:
    """The other side ended the pair (the target holds every block, or either side stopped)."""

    reason: str


@dataclass(frozen=True)
class PairLost:
    """This side found its pair's other side failing (a call to it failed or timed out): it goes
    on alone and tells the other side, should it still be there."""

    error: str


Event = (LoadAsked | PipelineStarted | BlockInHost | DiskNeeded | DiskReadStarted | DiskReadDone | BlockInEngine
         | EngineBuilt | LoadFinished | LoadFailed | UnloadAsked | Drained | StagePeerLost | RequestAdmitted
         | RequestEnded | PairFormed | PairEnded | PairLost)


# --- effects: what the worker must do ---------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """The command's acknowledgement."""

    accepted: bool
    detail: str


@dataclass(frozen=True)
class Refuse:
    """The command is refused with an error (a DomainError of this code)."""

    detail: str
    code: str


@dataclass(frozen=True)
class StartLoad:
    pass


@dataclass(frozen=True)
class Pin:
    block: int


@dataclass(frozen=True)
class ReadFromDisk:
    job: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class CancelRead:
    job: int


@dataclass(frozen=True)
class AnnounceBlock:
    """Say the block is in engine memory (and in the host tier)."""

    block: int


@dataclass(frozen=True)
class Attach:
    """Attach the engine: the instance takes requests from now."""

    reason: str


@dataclass(frozen=True)
class ReportLoaded:
    """Every block is in engine memory: say so (once; the planner times scale operations by it)."""


@dataclass(frozen=True)
class ReannounceLoaded:
    """A LoadModel came again for a loaded instance (a restarted planner resuming): say it again."""


@dataclass(frozen=True)
class EndLoad:
    """The load task stops at once (the instance was unloaded); it then feeds LoadFailed."""

    reason: str


@dataclass(frozen=True)
class Drain:
    """Take no new requests; the drain ends when the last running request ends (RequestEnded
    has the teardown's effects), or the worker feeds Drained once `timeout_s` passed (at once
    when no request runs). `abort_stages`: a pipeline whose stage may be gone never waits on it."""

    timeout_s: float
    abort_stages: bool
    reason: str


@dataclass(frozen=True)
class Detach:
    """The engine goes (its running requests end with an error); the instance serves no more."""


@dataclass(frozen=True)
class EvictFromEngine:
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class ReleasePins:
    blocks: tuple[int, ...]
    keep_alive_s: float | None = None  # then they leave the host tier unless used again


@dataclass(frozen=True)
class ReportStopped:
    failed: bool
    reason: str
    switched_to: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopHosting:
    """Stop serving the pipeline's stage hosted here."""


@dataclass(frozen=True)
class StartPair:
    """Start this side of a live pair: the source offloads prefills' first layers to `peer`,
    the target serves those calls on the blocks it holds."""

    role: Literal["source", "target"]
    peer: str


@dataclass(frozen=True)
class EndPair:
    """Stop this side of the pair (the source runs every layer itself again, the target stops
    taking calls); `notify_peer`: this side ended it, so tell the other."""

    peer: str
    reason: str
    notify_peer: bool


Effect = (Answer | Refuse | StartLoad | Pin | ReadFromDisk | CancelRead | AnnounceBlock | Attach | ReportLoaded
          | ReannounceLoaded | EndLoad | Drain | Detach | EvictFromEngine | ReleasePins | ReportStopped | StopHosting
          | StartPair | EndPair)


# --- the transitions ------------------------------------------------------------------------------


def step(s: Lifecycle, ev: Event) -> tuple[Lifecycle, list[Effect]]:
    """The lifecycle after `ev`, and what the worker must do about it (in order)."""
    handler = _HANDLERS[type(ev)]
    return handler(s, ev)


def _load_asked(s: Lifecycle, ev: LoadAsked) -> tuple[Lifecycle, list[Effect]]:
    if s.phase is Phase.absent or s.forgettable:
        if not ev.readable:
            return s, [Refuse("checkpoint path is not readable", code="not_found")]
        fresh = Lifecycle(s.instance_id, Phase.loading, blocks=frozenset(ev.blocks),
                          serve_early=ev.serve_while_loading, load_running=True)
        return fresh, [StartLoad(), Answer(True, "loading")]
    if s.phase in (Phase.serving, Phase.pair_source) and s.loaded_reported:
        return s, [ReannounceLoaded(), Answer(True, "already loaded")]
    # Loading, stopping, or ended while its load task still runs: one load at a time.
    return s, [Answer(True, "already loaded or loading")]


def _pipeline_started(s: Lifecycle, ev: PipelineStarted) -> tuple[Lifecycle, list[Effect]]:
    if s.phase is not Phase.absent and not s.forgettable:
        return s, []  # sent again: already serving
    if ev.entry:  # its blocks are other loads' (no pins of its own); loaded from its start
        return Lifecycle(s.instance_id, Phase.serving, kind="pipeline", attached=True, loaded_reported=True), []
    return Lifecycle(s.instance_id, Phase.stage, kind="stage"), []


def _block_in_host(s: Lifecycle, ev: BlockInHost) -> tuple[Lifecycle, list[Effect]]:
    # Pinned only while the load goes on: after an unload nothing would release it.
    if s.phase not in LOADING or ev.block not in s.blocks or ev.block in s.pins:
        return s, []
    return replace(s, pins=s.pins | {ev.block}), [Pin(ev.block)]


def _disk_needed(s: Lifecycle, ev: DiskNeeded) -> tuple[Lifecycle, list[Effect]]:
    if s.phase not in LOADING:
        return s, _end_load_if_unloaded(s)
    job = s.jobs_issued + 1
    return replace(s, jobs_issued=job, disk_jobs=s.disk_jobs | {job}), [ReadFromDisk(job, tuple(ev.blocks))]


def _disk_read_started(s: Lifecycle, ev: DiskReadStarted) -> tuple[Lifecycle, list[Effect]]:
    # Cancelled before it started (an unload while its start was under way): cancel it now.
    return s, [] if ev.job in s.disk_jobs else [CancelRead(ev.job)]


def _disk_read_done(s: Lifecycle, ev: DiskReadDone) -> tuple[Lifecycle, list[Effect]]:
    return replace(s, disk_jobs=s.disk_jobs - {ev.job}), []


def _block_in_engine(s: Lifecycle, ev: BlockInEngine) -> tuple[Lifecycle, list[Effect]]:
    if s.phase not in LOADING:
        # Unloaded meanwhile: the block is neither announced nor kept; the load ends.
        return s, _end_load_if_unloaded(s)
    s = replace(s, in_engine=s.in_engine | {ev.block})
    effects: list[Effect] = [AnnounceBlock(ev.block)]
    s, more = _maybe_serve(s)
    return s, effects + more


def _engine_built(s: Lifecycle, ev: EngineBuilt) -> tuple[Lifecycle, list[Effect]]:
    if s.phase not in LOADING:
        return replace(s, engine_built=True), _end_load_if_unloaded(s)
    return _maybe_serve(replace(s, engine_built=True))


def _end_load_if_unloaded(s: Lifecycle) -> list[Effect]:
    """An unload came while the load still runs: it stops at this step."""
    unloaded = s.phase in STOPPING or s.phase in ENDED
    return [EndLoad(UNLOADED_WHILE_LOADING)] if unloaded and s.load_running else []


def _maybe_serve(s: Lifecycle) -> tuple[Lifecycle, list[Effect]]:
    """With the engine built: attach once a block is in (serving early) or every block is, and
    report loaded once every block is."""
    if not s.engine_built:
        return s, []
    complete = s.in_engine >= s.blocks
    effects: list[Effect] = []
    if s.phase is Phase.pair_target:
        if not complete:
            return s, []  # lends its blocks to the source's prefills instead of serving early
        # The pair dissolves before it attaches: the source stops offloading, then both serve.
        effects.append(EndPair(s.pair_peer, PAIR_DISSOLVED, notify_peer=True))
        s = replace(s, phase=Phase.loading, pair_peer="")
    if not s.attached and (complete or (s.serve_early and s.in_engine)):
        effects.append(Attach("loaded" if complete else "serving, rest loading"))
        s = replace(s, attached=True, phase=Phase.serving_while_loading)
    if complete and s.attached and not s.loaded_reported:
        effects.append(ReportLoaded())
        s = replace(s, phase=Phase.serving, loaded_reported=True)
    return s, effects


def _load_finished(s: Lifecycle, ev: LoadFinished) -> tuple[Lifecycle, list[Effect]]:
    if s.phase in (Phase.loading, Phase.serving_while_loading, Phase.cancelling, Phase.pair_target):
        # Ended without every block in (or without its engine): nothing else would end it.
        return _load_failed(s, LoadFailed(LOAD_ENDED_EARLY))
    return replace(s, load_running=False, disk_jobs=frozenset()), [CancelRead(j) for j in sorted(s.disk_jobs)]


def _load_failed(s: Lifecycle, ev: LoadFailed) -> tuple[Lifecycle, list[Effect]]:
    s = replace(s, load_running=False)
    if s.phase in (Phase.loading, Phase.serving_while_loading, Phase.serving, *PAIRED_PHASES):
        s, unpaired = _unpair(s, f"the target failed: {ev.error}")
        s, effects = _teardown(replace(s, ends_as=Phase.failed, reason=ev.error))
        return s, unpaired + effects
    if s.phase is Phase.cancelling:
        # The unload cancelled its reads: their failure is the stop, not an error.
        return _teardown(replace(s, reason=ev.error))
    # Draining (the drain tears it down) or already ended: only its reads go.
    return replace(s, disk_jobs=frozenset()), [CancelRead(j) for j in sorted(s.disk_jobs)]


def _unload_asked(s: Lifecycle, ev: UnloadAsked) -> tuple[Lifecycle, list[Effect]]:
    asked = dict(reason=ev.reason, switched_to=tuple(ev.switched_to), keep_alive_s=ev.keep_alive_s)
    cancels: list[Effect] = [CancelRead(j) for j in sorted(s.disk_jobs)]
    s, unpaired = _unpair(s, f"{s.instance_id} unloaded: {ev.reason}")
    cancels += unpaired
    match s.phase:
        case Phase.loading:
            # Not attached yet: its reads stop now (within a read piece), the load at its next step.
            return (replace(s, phase=Phase.cancelling, disk_jobs=frozenset(), **asked),
                    cancels + [Answer(True, "load cancelled")])
        case Phase.serving_while_loading | Phase.serving:
            abort = s.kind == "pipeline" and not ev.switched_to  # a mode switch lets the step in flight finish
            return (replace(s, phase=Phase.draining, disk_jobs=frozenset(), **asked),
                    cancels + [Drain(ev.drain_timeout_s, abort, ev.reason), Answer(True, "draining")])
        case Phase.stage:
            return replace(s, phase=Phase.stopped), [StopHosting(), Answer(True, "stage stopped")]
        case Phase.cancelling:
            return s, [Answer(True, "load cancelled")]
        case Phase.draining:
            return s, [Answer(True, "draining")]
        case _:
            return s, [Answer(False, NOT_HERE)]


def _unpair(s: Lifecycle, reason: str) -> tuple[Lifecycle, list[Effect]]:
    """This side ends its live pair (it stops or fails): tell the peer; the phase the pair came
    from (serving, loading) goes on for the stop's own transition."""
    match s.phase:
        case Phase.pair_source:
            back = Phase.serving
        case Phase.pair_target:
            back = Phase.loading
        case _:
            return s, []
    return replace(s, phase=back, pair_peer=""), [EndPair(s.pair_peer, reason, notify_peer=True)]


def _pair_formed(s: Lifecycle, ev: PairFormed) -> tuple[Lifecycle, list[Effect]]:
    wanted = Phase.pair_source if ev.role == "source" else Phase.pair_target
    if s.phase is wanted and s.pair_peer == ev.peer:
        return s, [Answer(True, "already paired")]  # sent again
    # A source holds every block and serves alone; a target is still loading and attached to
    # nothing (it serves nothing of its own until the pair dissolves). Pipelines never pair.
    can = s.kind == "local" and (
        (ev.role == "source" and s.phase is Phase.serving)
        or (ev.role == "target" and s.phase is Phase.loading and not s.attached))
    if not can:
        return s, [Refuse(f"{NOT_PAIRABLE} as {ev.role} while {s.phase}", code="unavailable")]
    return replace(s, phase=wanted, pair_peer=ev.peer), [StartPair(ev.role, ev.peer), Answer(True, PAIRED)]


def _pair_ended(s: Lifecycle, ev: PairEnded) -> tuple[Lifecycle, list[Effect]]:
    if s.phase is Phase.pair_source:
        return replace(s, phase=Phase.serving, pair_peer=""), [EndPair(s.pair_peer, ev.reason, notify_peer=False)]
    if s.phase is Phase.pair_target:
        effects: list[Effect] = [EndPair(s.pair_peer, ev.reason, notify_peer=False)]
        s = replace(s, phase=Phase.loading, pair_peer="")
        s, more = _maybe_serve(s)  # a plain load again: it may serve early now
        return s, effects + more
    return s, []  # not paired (any more): the notice crossed this side's own end


def _pair_lost(s: Lifecycle, ev: PairLost) -> tuple[Lifecycle, list[Effect]]:
    if s.phase not in PAIRED_PHASES:
        return s, []
    s, effects = _unpair(s, f"the pair's other side failed: {ev.error}")
    s, more = _maybe_serve(s)  # a target goes on as a plain load (it may serve early now)
    return s, effects + more


def _drained(s: Lifecycle, ev: Drained) -> tuple[Lifecycle, list[Effect]]:
    if s.phase is not Phase.draining:
        return s, []
    return _teardown(s)


def _request_admitted(s: Lifecycle, ev: RequestAdmitted) -> tuple[Lifecycle, list[Effect]]:
    if not s.serving:  # loading, draining, cancelling, a stage, ended, not here: takes none
        return s, [Refuse(NOT_SERVING, code="unavailable")]
    return replace(s, requests=s.requests | {ev.request_id}), [Answer(True, ADMITTED)]


def _request_ended(s: Lifecycle, ev: RequestEnded) -> tuple[Lifecycle, list[Effect]]:
    if ev.request_id not in s.requests:
        return s, []  # never admitted here, or already gone (its engine detached)
    s = replace(s, requests=s.requests - {ev.request_id})
    if s.phase is Phase.draining and not s.requests:
        return _teardown(s)  # the last one: the drain is over, without waiting for its deadline
    return s, []


def _stage_peer_lost(s: Lifecycle, ev: StagePeerLost) -> tuple[Lifecycle, list[Effect]]:
    if s.kind != "pipeline" or s.phase not in SERVING:
        return s, []  # a local engine's failure is its requests' (they got the error)
    reason = f"a stage failed: {ev.error}"
    return (replace(s, phase=Phase.draining, ends_as=Phase.failed, reason=reason),
            [Drain(0.0, True, reason)])


def _teardown(s: Lifecycle) -> tuple[Lifecycle, list[Effect]]:
    """Everything the instance holds goes, then its end is reported (once: it is ended after)."""
    effects: list[Effect] = [CancelRead(j) for j in sorted(s.disk_jobs)]
    if s.attached:
        effects.append(Detach())
    if s.in_engine:
        effects.append(EvictFromEngine(tuple(sorted(s.in_engine))))
    if s.pins:
        effects.append(ReleasePins(tuple(sorted(s.pins)), s.keep_alive_s))
    ended = Phase.failed if s.ends_as is Phase.failed else Phase.stopped
    effects.append(ReportStopped(ended is Phase.failed, s.reason, s.switched_to))
    # Detach ends the requests still running (with an error): none runs on it any more.
    return replace(s, phase=ended, disk_jobs=frozenset(), attached=False, in_engine=frozenset(),
                   pins=frozenset(), requests=frozenset()), effects


_HANDLERS = {
    LoadAsked: _load_asked, PipelineStarted: _pipeline_started, BlockInHost: _block_in_host,
    DiskNeeded: _disk_needed, DiskReadStarted: _disk_read_started, DiskReadDone: _disk_read_done,
    BlockInEngine: _block_in_engine, EngineBuilt: _engine_built, LoadFinished: _load_finished,
    LoadFailed: _load_failed, UnloadAsked: _unload_asked, Drained: _drained, StagePeerLost: _stage_peer_lost,
    RequestAdmitted: _request_admitted, RequestEnded: _request_ended, PairFormed: _pair_formed,
    PairEnded: _pair_ended, PairLost: _pair_lost,
}
