"""A scale operation's whole lifecycle as a pure state machine.

``step(op, event, now) -> (op, effects)``: the planner opens an operation with
:func:`open_scale_up` / :func:`open_scale_down` (or takes one over after a restart with
:func:`resume`), feeds it every answer and event that concerns it (a worker's ack, an
instance's report, a block in engine memory, a periodic :class:`Tick`) and carries out the
:class:`Effect` s it gets back, feeding their answers in again. Nothing here does I/O: the
effects say what to send and to whom, the service sends it.

An operation is ``running`` until every target ended (loaded, failed, stopped, or given up on
after :attr:`Timers.give_up_s`), then it has an :data:`Outcome` and its closing record goes
out; it stays *settled* only once the pipelines it retired have stopped their stages too.

Also here, because they are the planner's decisions and not its I/O: which operations a
restarted planner resumes (:func:`resume_plan`), the pool-fill throttle
(:func:`admit_pool_fill`), and how a worker command travels (:func:`plan_part_id`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from libs.planning.pipelines import FormedPipeline, pipelines_to_form, pipelines_to_retire
from libs.planning.scaleout import ScaleIn, ScalePlan, mode_spec, target_load
from libs.protocol import messages as m

__all__ = [
    "Timers", "Target", "PipelineWatch", "PairWatch", "ScaleOp", "Outcome",
    "Event", "PartsAnswered", "InstanceCreated", "LoadAnswered", "InstanceReported", "BlockReported",
    "PipelineRegistered", "PipelineStartAnswered", "SwitchAnswered", "DrainAnswered", "PairAnswered", "WorkerLost",
    "Tick", "Effect", "Record", "SendParts", "CancelParts", "CreateInstance", "SendLoad", "Announce", "FormPipeline",
    "StartPipeline", "SwitchPipeline", "UnloadStages", "Drain", "FormPair", "CheckInstances", "Ended", "Trace", "Log",
    "open_live_pairs",
    "open_scale_up", "open_scale_down", "resume", "resume_plan", "step", "outcome_of", "measured_load_s", "concerns",
    "PoolFills", "admit_pool_fill", "forget_pool_model", "plan_part_id",
]

Outcome = Literal["done", "partial", "failed", "aborted"]
RESTARTED = "the planner restarted"


@dataclass(frozen=True)
class Timers:
    """The planner's periodic checks and deadlines; the service schedules what these say."""

    tick_s: float = 5.0  # every open operation gets a Tick this often
    check_instances_s: float = 5.0  # a running scale-out reads its targets' states from the registry (lost events)
    give_up_s: float = 900.0  # a scale-out still waiting this long after it was planned ends with what it has
    command_timeout_s: float = 5.0  # a worker that has not answered a command by then has failed it
    transfer_stall_s: float = 15.0  # a receiver that gets no byte for this long fails its part (disk instead)
    pool_check_s: float = 5.0  # how often the parameter pool's invariant is checked (also on deploy, worker loss)
    pool_fill_grace_s: float = 120.0  # a fill in flight is not repeated for this long


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


# A scale-out's target: creating -> loading -> (ready ->) loaded, or failed / stopped / draining (a
# scale-in took it) / given_up. A scale-in's victim: unloading -> stopped.
TargetState = Literal["creating", "loading", "ready", "loaded", "failed", "stopped", "draining", "given_up",
                      "unloading"]
_WAITING = frozenset({"creating", "loading", "ready", "unloading"})


@dataclass(frozen=True)
class Target:
    """One instance a scale-out brings up on one worker (or, for a scale-in, one victim)."""

    worker_id: str
    load: m.LoadModel | None  # what the worker is told (None: a scale-in's victim)
    state: TargetState = "creating"
    victim: m.InstanceInfo | None = None  # a scale-in's victim as the view showed it

    @property
    def waiting(self) -> bool:
        return self.state in _WAITING


@dataclass(frozen=True)
class PipelineWatch:
    """A scale-out whose receivers serve as execution pipelines while its blocks arrive."""

    groups: tuple[tuple[str, ...], ...]  # Alg. 2's groups (ScalePlan.pipelines)
    addresses: Mapping[str, str]  # worker -> data-plane address
    n_blocks: int
    holdings: Mapping[str, frozenset[int]] = field(default_factory=dict)  # worker -> blocks in engine memory
    started: tuple[tuple[str, ...], ...] = ()  # groups formed (whatever became of them)
    local: frozenset[str] = frozenset()  # targets whose local instance holds every block
    closed: bool = False  # its operation ended: no pipeline forms any more


@dataclass(frozen=True)
class PairWatch:
    """A live pair (BlitzScale §5.2) the operation forms: a serving instance of the model and one
    of its targets still receiving it. planned -> forming (FormLivePair sent, once the target's
    load is accepted) -> paired -> ended (the target loaded, failed or stopped, the source
    stopped, either worker lost, or a side refused): the planner frees both then."""

    source_instance: str
    source_worker: str
    target_worker: str
    peers: Mapping[str, str]  # both workers -> data-plane address
    state: Literal["planned", "forming", "paired", "ended"] = "planned"

    @property
    def open(self) -> bool:
        return self.state != "ended"


@dataclass(frozen=True)
class ScaleOp:
    """One scale operation as the planner knows it."""

    info: m.ScaleOpInfo  # the record as first written (its state and timings are below)
    model: m.ModelInfo | None  # None: a scale-in
    targets: Mapping[str, Target]  # instance id -> target (a scale-in: its victims)
    timings: Mapping[str, float]
    plan: Mapping  # the recorded plan (its kind becomes local-load when a worker refuses its part)
    opened_at: float = 0.0  # when this planner opened (or resumed) it
    state: Literal["running", "done", "aborted"] = "running"
    outcome: Outcome | None = None
    scale: ScalePlan | None = None  # the scale-out's plan (a resumed one has none)
    transfer_id: str | None = None  # the multicast every receiver's load waits for
    sending: bool = False  # its parts are out, not every answer is in
    watch: PipelineWatch | None = None
    forming: Mapping[str, FormedPipeline] = field(default_factory=dict)  # registered or starting
    serving: Mapping[str, FormedPipeline] = field(default_factory=dict)  # pipeline instance -> its pipeline
    # Pipelines in their mode switch: their entry finishes its step, then their stages stop.
    retiring: Mapping[str, FormedPipeline] = field(default_factory=dict)
    checked_at: float = 0.0  # the last registry check of the targets' states
    pairs: Mapping[str, PairWatch] = field(default_factory=dict)  # target instance -> its live pair

    @property
    def op_id(self) -> str:
        return self.info.scale_op_id

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    @property
    def settled(self) -> bool:
        """Ended, and nothing it started still needs the planner (no pipeline forming or retiring)."""
        return self.ended and not self.retiring and not self.forming

    @property
    def phase(self) -> Literal["sending", "loading", "done", "failed", "aborted"]:
        """sending: a multicast's parts are out, not all answered; loading: the targets are being
        created, loaded or followed; then how it ended (a partial scale-out is done)."""
        if self.state == "aborted":
            return "aborted"
        if self.ended:
            return "failed" if self.outcome == "failed" else "done"
        if self.sending:
            return "sending"
        return "loading"

    def waiting(self) -> list[str]:
        return [iid for iid, t in self.targets.items() if t.waiting]

    def record(self) -> m.ScaleOpInfo:
        """The registry record of the operation as it stands."""
        return self.info.model_copy(update={"state": self.state, "timings": dict(self.timings),
                                            "plan": dict(self.plan)})


# --- events (what the planner observes) --------------------------------------------------------------
@dataclass(frozen=True)
class PartsAnswered:
    """Every worker answered its TransferPart; `refused`: worker -> why (empty: all accepted)."""

    sent: tuple[str, ...]  # the workers that were sent a part
    refused: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceCreated:
    """The registry's answer to a target's CreateInstance (`error`: it was not created)."""

    instance_id: str
    error: str | None = None


@dataclass(frozen=True)
class LoadAnswered:
    """A target's worker answered its LoadModel (`error`: refused, gone or silent)."""

    instance_id: str
    error: str | None = None


@dataclass(frozen=True)
class InstanceReported:
    """An instance event, or the registry's state of an instance (a target's or a pipeline's)."""

    instance: m.InstanceInfo


@dataclass(frozen=True)
class BlockReported:
    block: m.BlockEvent


@dataclass(frozen=True)
class PipelineRegistered:
    instance_id: str
    error: str | None = None


@dataclass(frozen=True)
class PipelineStartAnswered:
    """Every stage worker answered its StartPipeline (`error`: the first refusal)."""

    instance_id: str
    error: str | None = None


@dataclass(frozen=True)
class SwitchAnswered:
    """A retiring pipeline's entry answered its UnloadModel (the mode switch)."""

    instance_id: str
    error: str | None = None


@dataclass(frozen=True)
class DrainAnswered:
    """A scale-in victim's worker answered its UnloadModel."""

    instance_id: str
    error: str | None = None


@dataclass(frozen=True)
class PairAnswered:
    """Both workers of a live pair answered its FormLivePair (`error`: the first refusal; the
    target's part, if it was formed, was ended again)."""

    target_instance: str
    error: str | None = None


@dataclass(frozen=True)
class WorkerLost:
    worker_id: str


@dataclass(frozen=True)
class Tick:
    """The periodic check (every Timers.tick_s)."""


Event = (PartsAnswered | InstanceCreated | LoadAnswered | InstanceReported | BlockReported | PipelineRegistered
         | PipelineStartAnswered | SwitchAnswered | DrainAnswered | PairAnswered | WorkerLost | Tick)


# --- effects (what the planner does) -------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """Write the operation's record to the registry; `background`: beside what follows, not before it
    (a later Record of the operation still goes after it)."""

    info: m.ScaleOpInfo
    background: bool = False


@dataclass(frozen=True)
class SendParts:
    """Send every multicast node its TransferPart through the plan stream (answer: PartsAnswered)."""

    scale: ScalePlan
    transfer_id: str
    addresses: Mapping[str, str]  # node -> data-plane address


@dataclass(frozen=True)
class CancelParts:
    """Tell these workers to cancel their accepted parts (in the background)."""

    workers: tuple[str, ...]
    cancel: m.CancelTransfer


@dataclass(frozen=True)
class CreateInstance:
    """Create the target's instance in the registry and announce it (answer: InstanceCreated)."""

    worker_id: str
    load: m.LoadModel
    reason: str


@dataclass(frozen=True)
class SendLoad:
    """Send the worker its LoadModel through the plan stream with message id `part_id` (answer: LoadAnswered)."""

    worker_id: str
    load: m.LoadModel
    part_id: str


@dataclass(frozen=True)
class Announce:
    """Publish an instance event."""

    instance: m.InstanceInfo
    reason: str = ""
    switched_to: tuple[str, ...] = ()


@dataclass(frozen=True)
class FormPipeline:
    """Register the pipeline as an instance (answer: PipelineRegistered)."""

    instance: m.InstanceInfo


@dataclass(frozen=True)
class StartPipeline:
    """Send `start` to the later stages, then to the entry (answer: PipelineStartAnswered)."""

    workers: tuple[str, ...]  # in stage order; the first is the entry
    start: m.StartPipeline


@dataclass(frozen=True)
class SwitchPipeline:
    """Tell the retiring pipeline's entry to switch (answer: SwitchAnswered)."""

    entry: str
    unload: m.UnloadModel


@dataclass(frozen=True)
class UnloadStages:
    """Stop these stage workers' parts of a pipeline, one after another (no answer)."""

    workers: tuple[str, ...]
    unload: m.UnloadModel


@dataclass(frozen=True)
class Drain:
    """Tell a scale-in victim's worker to drain and stop it (answer: DrainAnswered)."""

    worker_id: str
    unload: m.UnloadModel


@dataclass(frozen=True)
class FormPair:
    """Send `form` to the pair's target, then to its source (answer: PairAnswered)."""

    form: m.FormLivePair


@dataclass(frozen=True)
class CheckInstances:
    """Read these instances' states from the registry and report each (InstanceReported): events lost
    on their way to the planner are recovered from the registry."""

    instance_ids: tuple[str, ...]


@dataclass(frozen=True)
class Ended:
    """The operation ended: count it (instances_ready: its targets with every block loaded)."""

    info: m.ScaleOpInfo
    outcome: Outcome
    instances_ready: int


@dataclass(frozen=True)
class Trace:
    """An event on the operation's span."""

    name: str
    attributes: Mapping[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class Log:
    level: Literal["info", "warning"]
    text: str


Effect = (Record | SendParts | CancelParts | CreateInstance | SendLoad | Announce | FormPipeline | StartPipeline
          | SwitchPipeline | UnloadStages | Drain | FormPair | CheckInstances | Ended | Trace | Log)


# --- opening -------------------------------------------------------------------------------------------
def open_scale_up(info: m.ScaleOpInfo, scale: ScalePlan, instance_ids: Mapping[str, str],
                  addresses: Mapping[str, str], now: float) -> tuple[ScaleOp, list[Effect]]:
    """A scale-out of `scale`, recorded as `info` (state running). `instance_ids`: target worker ->
    its new instance's id; `addresses`: alive worker -> data-plane address.

    Bytes first: the transfer parts go out before anything else (decision -> first byte is the
    scale-out's latency), the record beside them; the instances are created once every part
    is accepted (or one was refused: then every target loads on its own)."""
    model, sid = scale.model, info.scale_op_id
    targets = {instance_ids[t.worker_id]: Target(t.worker_id, t.command(model, instance_ids[t.worker_id], sid))
               for t in scale.loads}
    # Each live pair waits for its target's load to be accepted (the target's instance exists then).
    pairs = {instance_ids[p.target_worker]: PairWatch(p.source_instance, p.source_worker, p.target_worker,
                                                      _frozen({w: addresses[w] for w in (p.source_worker,
                                                                                         p.target_worker)}))
             for p in scale.live_pairs}
    op = ScaleOp(info=info, model=model, targets=_frozen(targets), timings=_frozen(info.timings),
                 plan=_frozen(info.plan), scale=scale, opened_at=now, checked_at=now, pairs=_frozen(pairs))
    effects: list[Effect] = [Record(op.record(), background=True)]
    if scale.multicast is None:
        return op, effects + _create_all(op)
    transfer_id = f"{sid}-{scale.multicast.algorithm}"
    watch = None
    if scale.pipelines:
        watch = PipelineWatch(tuple(tuple(g) for g in scale.pipelines),
                              _frozen({w: addresses[w] for w in scale.targets}), len(model.blocks))
    op = dataclasses.replace(op, transfer_id=transfer_id, watch=watch, sending=True,
                             timings=_frozen({**op.timings, "first_send": now}))
    nodes = scale.nodes()
    return op, effects + [SendParts(scale, transfer_id, _frozen({w: addresses[w] for w in nodes}))]


def open_scale_down(info: m.ScaleOpInfo, scale_in: ScaleIn, drain_timeout_s: float, reason: str,
                    now: float) -> tuple[ScaleOp, list[Effect]]:
    """A scale-in: stop routing to each victim, then let its worker finish what it has."""
    targets = {}
    effects: list[Effect] = [Record(info)]
    for inst in scale_in.victims:
        targets[inst.instance_id] = Target(inst.entry_worker, None, "unloading", victim=inst)
        effects += [Announce(inst.model_copy(update={"state": m.InstanceState.draining}), reason),
                    Drain(inst.entry_worker, m.UnloadModel(
                        instance_id=inst.instance_id, drain_timeout_s=drain_timeout_s,
                        scale_op_id=info.scale_op_id, host_keep_alive_s=scale_in.host_keep_alive_s))]
    op = ScaleOp(info=info, model=None, targets=_frozen(targets), timings=_frozen(info.timings),
                 plan=_frozen(info.plan), opened_at=now, checked_at=now)
    if not targets:
        return _close(op, now, effects)
    return op, effects


def _create_all(op: ScaleOp) -> list[Effect]:
    return [CreateInstance(t.worker_id, t.load, op.info.reason) for t in op.targets.values()]


# --- after a restart -----------------------------------------------------------------------------------
def _pending(inst: m.InstanceInfo) -> bool:
    """Still on its way: loading, or serving (serve-while-loading) without every block."""
    return inst.state == m.InstanceState.loading or inst.state == m.InstanceState.ready and inst.loaded_at is None


def resume_plan(view: m.ClusterView, open_ids: Collection[str] = ()
                ) -> list[tuple[m.ScaleOpInfo, list[m.InstanceInfo]]]:
    """The operations a starting planner takes over from the registry's view, each with the
    instances it still follows ([]: nothing to follow, the operation ends as aborted).

    A scale-out whose local instances are still on their way is resumed; one with nothing left
    to follow, of an unknown model, and any scale-in (its drains were sent or its victims still
    serve; the load-monitor repeats its request) is aborted. `open_ids`: operations this planner
    follows already (left alone). Depends on the view only: any planner decides the same."""
    models = {x.name for x in view.models}
    out = []
    for op in view.scale_ops:
        if op.state not in ("planned", "running") or op.scale_op_id in open_ids:
            continue
        pending = [i for i in view.instances if i.scale_op_id == op.scale_op_id and _pending(i)]
        out.append((op, pending if op.direction == "up" and op.model in models else []))
    return out


def resume(info: m.ScaleOpInfo, pending: list[m.InstanceInfo], model: m.ModelInfo | None,
           now: float) -> tuple[ScaleOp, list[Effect]]:
    """Take over an operation a previous planner left open (see :func:`resume_plan`).

    Each instance still on its way is sent its LoadModel again, under a message id of its own
    (idempotent on the worker: a load that is running or done just says so; one that never
    reached the worker starts now), and followed to its end as usual."""
    if not pending or model is None or info.direction != "up":
        op = ScaleOp(info=info, model=model, targets=_frozen({}), timings=_frozen(info.timings),
                     plan=_frozen(info.plan), state="aborted", outcome="aborted", opened_at=now)
        closing = op.record().model_copy(update={"error": RESTARTED, "timings": {**info.timings, "done": now}})
        return dataclasses.replace(op, info=closing, timings=_frozen(closing.timings)), [Record(closing)]
    targets = {}
    for inst in pending:
        stage = inst.stages[0]
        load = target_load(model.scaling_mode, stage.worker_id, stage.block_start,
                           stage.block_end).command(model, inst.instance_id, info.scale_op_id)
        targets[inst.instance_id] = Target(stage.worker_id, load, "loading")
    op = ScaleOp(info=info, model=model, targets=_frozen(targets), timings=_frozen(info.timings),
                 plan=_frozen(info.plan), opened_at=now, checked_at=now)
    effects: list[Effect] = [Log("warning", f"resuming scale operation {info.scale_op_id} left open by a previous "
                                            f"planner: {len(pending)} instance(s) to follow")]
    effects += [SendLoad(t.worker_id, t.load, f"{iid}:resume") for iid, t in targets.items()]
    return op, effects


# --- the step --------------------------------------------------------------------------------------------
def step(op: ScaleOp, event: Event, now: float, timers: Timers = Timers()) -> tuple[ScaleOp, list[Effect]]:
    """The operation after `event`, and what to do about it."""
    handler = _HANDLERS[type(event)]
    op, effects = handler(op, event, now, timers)
    op, effects = _free_pairs(op, now, effects)
    if op.state == "running" and not op.waiting():
        op, effects = _close(op, now, effects)
    return op, effects


def outcome_of(op: ScaleOp) -> tuple[Outcome, int]:
    """done: every target loaded; partial: some; failed: none (and the targets loaded so far)."""
    if op.model is None:
        return "done", 0
    ready = sum(1 for k in op.timings if k.startswith("loaded:"))
    wanted = op.info.to_instances - op.info.from_instances
    return ("done" if ready == wanted else "partial" if ready else "failed"), ready


def measured_load_s(op: ScaleOp) -> dict[str, float]:
    """worker -> seconds from the plan to its target's every block in engine memory: what the
    plan's estimated_load_s (ServerlessLLM §6.2) estimated, for the targets that loaded."""
    planned = op.timings.get("planned")
    if planned is None:
        return {}
    return {t.worker_id: round(max(0.0, op.timings[f"loaded:{iid}"] - planned), 6)
            for iid, t in op.targets.items() if f"loaded:{iid}" in op.timings}


def _close(op: ScaleOp, now: float, effects: list[Effect]) -> tuple[ScaleOp, list[Effect]]:
    """Every target ended: no pipeline is needed any more; the closing record goes out."""
    effects = list(effects)
    for iid in list(op.serving):
        op, more = _retire(op, iid, now)
        effects += more
    if op.watch is not None:
        op = dataclasses.replace(op, watch=dataclasses.replace(op.watch, closed=True))
    outcome, ready = outcome_of(op)
    op = dataclasses.replace(op, state="done", outcome=outcome, timings=_frozen({**op.timings, "done": now}))
    if "estimated_load_s" in op.plan and (measured := measured_load_s(op)):
        op = dataclasses.replace(op, plan=_frozen({**op.plan, "measured_load_s": measured}))
    record = op.record()
    return op, effects + [Record(record), Ended(record, outcome, ready)]


def _target(op: ScaleOp, iid: str, state: TargetState) -> ScaleOp:
    targets = dict(op.targets)
    targets[iid] = dataclasses.replace(targets[iid], state=state)
    return dataclasses.replace(op, targets=_frozen(targets))


def _timed(op: ScaleOp, **timings: float) -> ScaleOp:
    return dataclasses.replace(op, timings=_frozen({**op.timings, **timings}))


def _failed_instance(op: ScaleOp, iid: str, now: float) -> m.InstanceInfo:
    t = op.targets[iid]
    return m.InstanceInfo(instance_id=iid, model=t.load.model, state=m.InstanceState.failed, created_at=now,
                          scale_op_id=op.op_id, stages=[m.Stage(worker_id=t.worker_id, block_start=t.load.block_start,
                                                                block_end=t.load.block_end)])


def _target_failed(op: ScaleOp, iid: str, why: str, now: float) -> tuple[ScaleOp, list[Effect]]:
    if iid not in op.targets or not op.targets[iid].waiting:
        return op, []
    info = _failed_instance(op, iid, now)
    return _target(op, iid, "failed"), [Announce(info, why)]


def _on_parts(op: ScaleOp, ev: PartsAnswered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    if op.state != "running" or not op.sending:
        return op, []
    scale, op = op.scale, dataclasses.replace(op, sending=False)
    if ev.refused:
        # No multicast without every part: the accepted ones stop, every target loads on its own.
        refused = ",".join(ev.refused)
        timings = {k: v for k, v in op.timings.items() if k != "first_send"}
        cancel = m.CancelTransfer(transfer_id=op.transfer_id, reason=f"{refused} refused their parts")
        op = dataclasses.replace(op, transfer_id=None, watch=None, timings=_frozen(timings),
                                 plan=_frozen({**op.plan, "kind": "local-load"}))
        workers = tuple(w for w in ev.sent if w not in ev.refused)
        effects: list[Effect] = [
            Log("warning", f"scale-up {op.op_id}: {refused} refused their {scale.multicast.algorithm} parts "
                           f"({'; '.join(ev.refused.values())}); targets load on their own"),
            CancelParts(workers, cancel)]
        return op, effects + _create_all(op)
    targets = {iid: (dataclasses.replace(t, load=t.load.model_copy(update={"incoming_transfer": op.transfer_id}))
                     if _receives(scale, t.worker_id) else t)
               for iid, t in op.targets.items()}
    op = dataclasses.replace(op, targets=_frozen(targets))
    log = Log("info", f"scale-up {op.op_id}: {scale.multicast.algorithm} k={scale.multicast.k} from "
                      f"{','.join(scale.senders)} to {','.join(scale.receivers)}")
    return op, [log, *_create_all(op)]


def _receives(scale: ScalePlan, worker_id: str) -> bool:
    return any(t.receives for t in scale.loads if t.worker_id == worker_id)


def _on_created(op: ScaleOp, ev: InstanceCreated, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    t = op.targets.get(ev.instance_id)
    if t is None or t.state != "creating":
        return op, []
    if ev.error is not None:
        op = _target(op, ev.instance_id, "loading")
        return _target_failed(op, ev.instance_id, ev.error, now)
    return _target(op, ev.instance_id, "loading"), [SendLoad(t.worker_id, t.load, plan_part_id(t.worker_id, t.load))]


def _on_load_answer(op: ScaleOp, ev: LoadAnswered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    t = op.targets.get(ev.instance_id)
    if t is None or not t.waiting:  # late: the target ended meanwhile
        return op, []
    if ev.error is None:
        op, pairing = _form_pair(op, ev.instance_id)
        return op, [Log("info", f"scale-up {op.op_id}: {t.worker_id} loads {t.load.model}"), *pairing]
    op, effects = _target_failed(op, ev.instance_id, ev.error, now)
    return op, [Log("warning", f"scale-up {op.op_id}: worker {t.worker_id} refused: {ev.error}"), *effects]


def _on_instance(op: ScaleOp, ev: InstanceReported, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    inst = ev.instance
    if inst.mode == "pipeline":
        return _on_pipeline_instance(op, inst, now)
    iid = inst.instance_id
    if inst.state in (m.InstanceState.failed, m.InstanceState.stopped, m.InstanceState.draining):
        # A pair's source stopping ends its pair (its worker tells the target).
        op = _end_pairs(op, lambda p: p.source_instance == iid)
    t = op.targets.get(iid)
    if t is None or not t.waiting or inst.state == m.InstanceState.loading or op.model is None:
        return op, []
    attrs = {"layercast.instance": iid, "layercast.worker": inst.entry_worker}
    effects: list[Effect] = []
    if inst.state == m.InstanceState.ready:
        # Serving (from its first block, with serve-while-loading); the target is done once
        # every block is loaded.
        if f"ready:{iid}" not in op.timings:
            op = _timed(op, **{f"ready:{iid}": inst.ready_at or now})
            effects.append(Trace("instance_ready", attrs))
        if inst.loaded_at is None:
            return _target(op, iid, "ready"), effects
        op = _target(_timed(op, **{f"loaded:{iid}": inst.loaded_at}), iid, "loaded")
        effects.append(Trace("instance_loaded", attrs))
        op, more = _local_loaded(op, inst.entry_worker, now)
        return op, effects + more
    # failed, or stopped/draining: a scale-in took it before it was loaded
    state: TargetState = "failed" if inst.state == m.InstanceState.failed else (
        "draining" if inst.state == m.InstanceState.draining else "stopped")
    op = _target(_timed(op, **{f"{inst.state.value}:{iid}": now}), iid, state)
    return op, [Trace(f"instance_{inst.state.value}", attrs)]


# --- execution pipelines (λScale §4.3-4.4) ----------------------------------------------------------------
def _pipeline_info(model: str, iid: str, pipeline: FormedPipeline, state: m.InstanceState,
                   now: float) -> m.InstanceInfo:
    return m.InstanceInfo(instance_id=iid, model=model, mode="pipeline", state=state, created_at=now,
                          stages=[m.Stage(worker_id=s.worker_id, block_start=s.block_start, block_end=s.block_end)
                                  for s in pipeline.stages])


def _pipeline_id(op: ScaleOp, n: int) -> str:
    return f"pipe-{op.op_id.removeprefix('op-')}-{n}"


def _on_block(op: ScaleOp, ev: BlockReported, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    """A receiver made a block ready in engine memory: start the pipelines that can serve now."""
    b, watch = ev.block, op.watch
    if watch is None or watch.closed or b.tier != m.Tier.gpu or b.state != m.ReplicaState.ready:
        return op, []
    holdings = {**watch.holdings, b.worker_id: frozenset({*watch.holdings.get(b.worker_id, ()), b.block_id})}
    watch = dataclasses.replace(watch, holdings=_frozen(holdings))
    forming = dict(op.forming)
    effects: list[Effect] = []
    for pipeline in pipelines_to_form(watch.groups, watch.holdings, watch.n_blocks, watch.started):
        iid = _pipeline_id(op, len(watch.started))
        watch = dataclasses.replace(watch, started=(*watch.started, pipeline.members))
        forming[iid] = pipeline
        effects.append(FormPipeline(_pipeline_info(op.model.name, iid, pipeline, m.InstanceState.loading, now)))
    return dataclasses.replace(op, watch=watch, forming=_frozen(forming)), effects


def _on_registered(op: ScaleOp, ev: PipelineRegistered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    iid = ev.instance_id
    pipeline = op.forming.get(iid)
    if pipeline is None:
        return op, []
    if ev.error is not None:
        forming = {k: v for k, v in op.forming.items() if k != iid}
        return dataclasses.replace(op, forming=_frozen(forming)), [
            Log("warning", f"scale-up {op.op_id}: pipeline over {','.join(pipeline.workers)} not registered: "
                           f"{ev.error}")]
    if op.watch is None or op.watch.closed:
        # Its operation ended while it was registered: it never serves.
        forming = {k: v for k, v in op.forming.items() if k != iid}
        info = _pipeline_info(op.model.name, iid, pipeline, m.InstanceState.stopped, now)
        return dataclasses.replace(op, forming=_frozen(forming)), [Announce(info, "its scale operation ended")]
    start = m.StartPipeline(instance_id=iid, model=op.model.name, path=op.model.path,
                            stages=_pipeline_info(op.model.name, iid, pipeline, m.InstanceState.loading, now).stages,
                            peers={w: op.watch.addresses[w] for w in pipeline.workers}, scale_op_id=op.op_id)
    op = dataclasses.replace(op, serving=_frozen({**op.serving, iid: pipeline}))
    return op, [StartPipeline(pipeline.workers, start)]


def _on_started(op: ScaleOp, ev: PipelineStartAnswered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    iid = ev.instance_id
    pipeline = op.forming.get(iid)
    if pipeline is None:
        return op, []
    op = dataclasses.replace(op, forming=_frozen({k: v for k, v in op.forming.items() if k != iid}))
    if ev.error is not None:
        effects: list[Effect] = [Log("warning", f"scale-up {op.op_id}: pipeline {iid} over "
                                                f"{','.join(pipeline.workers)} did not start: {ev.error}")]
        op, more = _end_pipeline(op, iid, m.InstanceState.failed, f"did not start: {ev.error}", now)
        return op, effects + more
    if iid not in op.serving:
        # Retired (or ended) while its stages were being built: the unloads may have come
        # before the stages, so stop them again.
        retiring = {k: v for k, v in op.retiring.items() if k != iid}
        return dataclasses.replace(op, retiring=_frozen(retiring)), [_unload_stages(op, iid, pipeline.workers)]
    stages = ", ".join(f"{s.worker_id}[{s.block_start},{s.block_end})" for s in pipeline.stages)
    return _timed(op, **{f"pipeline_ready:{iid}": now}), [
        Log("info", f"scale-up {op.op_id}: pipeline {iid} serving on {stages}"),
        Trace("pipeline_ready", {"layercast.instance": iid, "layercast.stages": len(pipeline.stages)})]


def _unload_stages(op: ScaleOp, iid: str, workers: Iterable[str]) -> UnloadStages:
    return UnloadStages(tuple(workers), m.UnloadModel(instance_id=iid, drain_timeout_s=0.0, scale_op_id=op.op_id))


def _local_loaded(op: ScaleOp, worker_id: str, now: float) -> tuple[ScaleOp, list[Effect]]:
    """A target holds the whole model: the pipelines all of whose stages do now retire."""
    if op.watch is None:
        return op, []
    op = dataclasses.replace(op, watch=dataclasses.replace(op.watch, local=op.watch.local | {worker_id}))
    effects: list[Effect] = []
    for iid in pipelines_to_retire({i: p.workers for i, p in op.serving.items()}, op.watch.local):
        op, more = _retire(op, iid, now)
        effects += more
    return op, effects


def _retire(op: ScaleOp, iid: str, now: float) -> tuple[ScaleOp, list[Effect]]:
    """λScale §4.4 mode switch: no new requests go to the pipeline; its entry finishes the step in
    flight (those tokens go out, no computed work is thrown away), then stops, and the gateway
    moves its unfinished requests to the new local instances (which rebuild their KV from the
    tokens so far). Its later stages stop once the entry has stopped."""
    pipeline = op.serving[iid]
    local = op.watch.local if op.watch is not None else frozenset()
    instance_of = {t.worker_id: i for i, t in op.targets.items()}
    switched_to = tuple(instance_of[w] for w in pipeline.workers if w in local and w in instance_of)
    op = dataclasses.replace(op, serving=_frozen({k: v for k, v in op.serving.items() if k != iid}),
                             retiring=_frozen({**op.retiring, iid: pipeline}))
    op = _timed(op, **{f"switched:{iid}": now})
    info = _pipeline_info(op.model.name, iid, pipeline, m.InstanceState.draining, now)
    unload = m.UnloadModel(instance_id=iid, drain_timeout_s=0.0, scale_op_id=op.op_id, switched_to=list(switched_to))
    return op, [Announce(info, "switching to local instances", switched_to),
                SwitchPipeline(pipeline.workers[0], unload),
                Trace("pipeline_switched", {"layercast.instance": iid})]


def _on_switched(op: ScaleOp, ev: SwitchAnswered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    pipeline = op.retiring.get(ev.instance_id)
    if ev.error is None or pipeline is None:
        return op, []
    return _stop_retired(op, ev.instance_id, pipeline.workers, [
        Log("info", f"pipeline {ev.instance_id}: its entry {pipeline.workers[0]} did not take the switch: {ev.error}")])


def _stop_retired(op: ScaleOp, iid: str, workers: Iterable[str], effects: list[Effect]) -> tuple[ScaleOp, list[Effect]]:
    retiring = {k: v for k, v in op.retiring.items() if k != iid}
    return dataclasses.replace(op, retiring=_frozen(retiring)), effects + [_unload_stages(op, iid, workers)]


def _end_pipeline(op: ScaleOp, iid: str, state: m.InstanceState, reason: str,
                  now: float) -> tuple[ScaleOp, list[Effect]]:
    """Stop routing to the pipeline (the gateway hands its requests over), then stop its stages."""
    pipeline = op.serving.get(iid)
    if pipeline is None:
        return op, []
    op = dataclasses.replace(op, serving=_frozen({k: v for k, v in op.serving.items() if k != iid}))
    return op, [Announce(_pipeline_info(op.model.name, iid, pipeline, state, now), reason),
                _unload_stages(op, iid, pipeline.workers)]


def _on_pipeline_instance(op: ScaleOp, inst: m.InstanceInfo, now: float) -> tuple[ScaleOp, list[Effect]]:
    iid = inst.instance_id
    if inst.state not in (m.InstanceState.failed, m.InstanceState.stopped):
        return op, []
    if iid in op.retiring:  # its entry stopped after the mode switch: the later stages stop now
        return _stop_retired(op, iid, op.retiring[iid].workers[1:], [])
    return _end_pipeline(op, iid, inst.state, "a stage failed", now)  # the entry reported a stage lost


def _on_worker_lost(op: ScaleOp, ev: WorkerLost, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    """A stage worker is gone: the pipelines it was part of fail (their requests are handed over);
    a live pair it was part of is over (the other side goes on alone: PairLost on the worker)."""
    op = _end_pairs(op, lambda p: ev.worker_id in (p.source_worker, p.target_worker))
    effects: list[Effect] = []
    for iid, pipeline in list(op.retiring.items()):
        if pipeline.workers[0] == ev.worker_id:  # an entry gone in its switch never reports stopping
            op, effects = _stop_retired(op, iid, pipeline.workers[1:], effects)
    for iid, pipeline in list(op.serving.items()):
        if ev.worker_id in pipeline.workers:
            op, more = _end_pipeline(op, iid, m.InstanceState.failed, f"worker {ev.worker_id} expired", now)
            effects += more
    return op, effects


# --- live pairs (BlitzScale §5.2) ----------------------------------------------------------------------------
def _form_pair(op: ScaleOp, target_iid: str) -> tuple[ScaleOp, list[Effect]]:
    """The target's load was accepted: its lifecycle is loading (stop-the-world), so it can pair."""
    pair = op.pairs.get(target_iid)
    if pair is None or pair.state != "planned":
        return op, []
    form = m.FormLivePair(model=op.model.name, path=op.model.path, source_instance=pair.source_instance,
                          source_worker=pair.source_worker, target_instance=target_iid,
                          target_worker=pair.target_worker, peers=dict(pair.peers), scale_op_id=op.op_id,
                          split=mode_spec(op.model.scaling_mode).live_pair_split)
    return _pair_state(op, target_iid, "forming"), [FormPair(form)]


def _pair_state(op: ScaleOp, target_iid: str, state: str) -> ScaleOp:
    pairs = {**op.pairs, target_iid: dataclasses.replace(op.pairs[target_iid], state=state)}
    return dataclasses.replace(op, pairs=_frozen(pairs))


def _end_pairs(op: ScaleOp, which: Callable[[PairWatch], bool]) -> ScaleOp:
    for iid, pair in op.pairs.items():
        if pair.open and which(pair):
            op = _pair_state(op, iid, "ended")
    return op


def _on_pair_answered(op: ScaleOp, ev: PairAnswered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    iid = ev.target_instance
    pair = op.pairs.get(iid)
    if pair is None or pair.state != "forming":  # ended meanwhile (its target loaded, a side went away)
        return op, []
    if ev.error is not None:
        return _pair_state(op, iid, "ended"), [
            Log("warning", f"scale-up {op.op_id}: live pair {pair.source_instance} -> {iid} not formed: {ev.error}")]
    op = _timed(_pair_state(op, iid, "paired"), **{f"paired:{iid}": now})
    return op, [Log("info", f"scale-up {op.op_id}: live pair: {pair.source_instance} on {pair.source_worker} runs "
                            f"its prefills' first blocks on {iid} on {pair.target_worker}"),
                Trace("live_pair_formed", {"layercast.source": pair.source_instance, "layercast.instance": iid})]


def _free_pairs(op: ScaleOp, now: float, effects: list[Effect]) -> tuple[ScaleOp, list[Effect]]:
    """A pair whose target is no longer on its way (loaded: the pair dissolved by itself at its
    last block; failed, stopped, given up) is over: both its instances are free again."""
    for iid, pair in op.pairs.items():
        t = op.targets.get(iid)
        if pair.open and (t is None or not t.waiting):
            op = _pair_state(op, iid, "ended")
    ended = [iid for iid, pair in op.pairs.items() if pair.state == "ended" and f"unpaired:{iid}" not in op.timings]
    for iid in ended:
        if f"paired:{iid}" in op.timings:
            op = _timed(op, **{f"unpaired:{iid}": now})
            effects = [*effects, Trace("live_pair_ended", {"layercast.instance": iid})]
    return op, effects


def open_live_pairs(ops: Iterable[ScaleOp]) -> list[m.LivePairInfo]:
    """The live pairs these operations formed (or are forming) that are not over: what the planner
    adds to its view (ClusterView.live_pairs) so the next decisions see both workers as busy."""
    return [m.LivePairInfo(source_instance=p.source_instance, source_worker=p.source_worker, target_instance=iid,
                           target_worker=p.target_worker, scale_op_id=op.op_id)
            for op in ops for iid, p in op.pairs.items() if p.open]


# --- scale-in ----------------------------------------------------------------------------------------------
def _on_drained(op: ScaleOp, ev: DrainAnswered, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    t = op.targets.get(ev.instance_id)
    if t is None or t.state != "unloading":
        return op, []
    op = _target(op, ev.instance_id, "stopped")
    if ev.error is None:
        return op, []
    # The worker is gone or never had it: the instance is over either way.
    stopped = t.victim.model_copy(update={"state": m.InstanceState.stopped})
    return op, [Log("warning", f"scale-down {op.op_id}: {t.worker_id}: {ev.error}"), Announce(stopped, ev.error)]


# --- the periodic check ------------------------------------------------------------------------------------
def _on_tick(op: ScaleOp, ev: Tick, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    if op.ended:
        return _let_go(op, now, timers)
    waiting = op.waiting()
    if not waiting:
        return op, []
    if now - op.opened_at >= timers.give_up_s:
        for iid in waiting:
            op = _target(_timed(op, **{f"given_up:{iid}": now}), iid, "given_up")
        return op, [Log("warning", f"scale-up {op.op_id}: gave up on {','.join(waiting)} after "
                                   f"{timers.give_up_s:.0f}s")]
    if op.model is not None and now - op.checked_at >= timers.check_instances_s:
        return dataclasses.replace(op, checked_at=now), [CheckInstances(tuple(waiting))]
    return op, []


def _let_go(op: ScaleOp, now: float, timers: Timers) -> tuple[ScaleOp, list[Effect]]:
    """An ended operation whose pipelines never reported their end (an answer or an event lost)
    stops waiting for them `give_up_s` after it ended: their stages are told to stop, so nothing
    it started is left running and the planner can forget it."""
    if op.settled or now - op.timings.get("done", now) < timers.give_up_s:
        return op, []
    effects: list[Effect] = []
    for iid, pipeline in {**op.forming, **op.retiring}.items():
        if iid in op.forming:
            info = _pipeline_info(op.model.name, iid, pipeline, m.InstanceState.stopped, now)
            effects.append(Announce(info, "its scale operation ended"))
        effects.append(_unload_stages(op, iid, pipeline.workers))
    return dataclasses.replace(op, forming=_frozen({}), retiring=_frozen({})), effects


_HANDLERS = {
    PartsAnswered: _on_parts, InstanceCreated: _on_created, LoadAnswered: _on_load_answer,
    InstanceReported: _on_instance, BlockReported: _on_block, PipelineRegistered: _on_registered,
    PipelineStartAnswered: _on_started, SwitchAnswered: _on_switched, DrainAnswered: _on_drained,
    PairAnswered: _on_pair_answered, WorkerLost: _on_worker_lost, Tick: _on_tick,
}


def concerns(op: ScaleOp, instance_id: str) -> bool:
    """Whether an instance's events go to this operation (a target, a pipeline of it, or the
    source of a live pair it formed)."""
    return instance_id in op.targets or instance_id in op.serving or instance_id in op.retiring \
        or instance_id in op.forming or any(p.open and p.source_instance == instance_id for p in op.pairs.values())


# --- the parameter pool's throttle -------------------------------------------------------------------------
PoolFills = Mapping[tuple[str, str], float]  # (model, worker) -> when a fill was sent


def admit_pool_fill(fills: PoolFills, model: str, worker: str, open_models: Collection[str], now: float,
                    timers: Timers = Timers()) -> tuple[PoolFills, bool]:
    """Whether to send a fill of `model`'s pool copy to `worker` now. A model with a scale-out
    open is left out (its loads are bringing copies into host tiers), and a fill sent within
    `pool_fill_grace_s` is not repeated (its blocks are still on their way)."""
    if model in open_models or now - fills.get((model, worker), float("-inf")) < timers.pool_fill_grace_s:
        return fills, False
    return _frozen({**fills, (model, worker): now}), True


def forget_pool_model(fills: PoolFills, model: str) -> PoolFills:
    """A deleted model's fills are forgotten (a redeploy fills again at once)."""
    return _frozen({k: t for k, t in fills.items() if k[0] != model})


# --- how a command travels -------------------------------------------------------------------------------------
def plan_part_id(worker_id: str, cmd: m.Message) -> str | None:
    """The plan stream's message id for a part of a plan (a TransferPart, a LoadModel); None for
    any other command, which goes as an RPC. The stream drops a part whose id it has seen, so a
    part sent again (a resumed load) needs an id of its own."""
    if isinstance(cmd, m.TransferPart):
        return f"{cmd.transfer_id}:{worker_id}"
    if isinstance(cmd, m.LoadModel):
        return f"{cmd.instance_id}:load"
    return None
