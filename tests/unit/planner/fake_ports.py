"""In-memory stand-ins for the planner's two ports (libs.bus.worker_commands.WorkerCommands,
services.planner.ports.ClusterRegistry): they record what the planner sends and answer as the
workers and the registry would, so PlannerService runs without NATS."""

import asyncio
from dataclasses import dataclass, field

from libs.bus.broker import RemoteError
from libs.protocol import messages as m


@dataclass
class Sent:
    worker_id: str
    cmd: m.Message
    part_id: str | None  # the plan stream's message id; None: an RPC


@dataclass
class InMemoryWorkers:
    """Workers that accept every command, except those told to refuse or to stay silent
    (a silent worker's answer never comes: the planner's wait times out, as over NATS)."""

    refuse: dict[str, str] = field(default_factory=dict)  # worker -> why
    silent: set[str] = field(default_factory=set)
    sent: list[Sent] = field(default_factory=list)

    def _answer(self, worker_id: str) -> str | None:
        if worker_id in self.silent:
            return f"no answer from {worker_id} within 5.0s"
        return self.refuse.get(worker_id)

    async def send_part(self, worker_id: str, part: m.Message, part_id: str) -> str | None:
        self.sent.append(Sent(worker_id, part, part_id))
        return self._answer(worker_id)

    async def command(self, worker_id: str, cmd: m.Message) -> str | None:
        self.sent.append(Sent(worker_id, cmd, None))
        return self._answer(worker_id)

    def of(self, kind: type) -> list[Sent]:
        return [s for s in self.sent if isinstance(s.cmd, kind)]


@dataclass
class InMemoryRegistry:
    """The registry's state as the planner reads and writes it. `heard` are the instance events
    published (by the planner, or by workers through `report`)."""

    view: m.ClusterView
    ops: dict[str, m.ScaleOpInfo] = field(default_factory=dict)
    heard: list[m.InstanceEvent] = field(default_factory=list)
    unavailable: bool = False
    record_delays: list[float] = field(default_factory=list)  # the next records' round trips, in order

    def __post_init__(self) -> None:
        self.instances = {i.instance_id: i for i in self.view.instances}

    async def cluster(self, recent_scale_ops: int = 0) -> m.ClusterView:
        if self.unavailable:
            raise TimeoutError("registry: no answer")
        ops = list(self.ops.values())[-recent_scale_ops:] if recent_scale_ops else []
        return self.view.model_copy(update={"instances": list(self.instances.values()), "scale_ops": ops})

    async def record(self, op: m.ScaleOpInfo) -> None:
        if self.record_delays:
            await asyncio.sleep(self.record_delays.pop(0))
        # As the registry's store does: the record's timings add to those it has collected.
        known = self.ops.get(op.scale_op_id)
        timings = {**(known.timings if known else {}), **op.timings}
        self.ops[op.scale_op_id] = op.model_copy(update={"timings": timings})

    async def create_instance(self, req: m.CreateInstance) -> m.InstanceInfo:
        if self.unavailable:
            raise RemoteError("registry.instance.create", m.ErrorReply(error="down", code="unavailable"))
        inst = m.InstanceInfo(instance_id=req.instance_id, model=req.model, stages=req.stages,
                              state=m.InstanceState.loading, created_at=0.0, scale_op_id=req.scale_op_id,
                              mode="pipeline" if req.instance_id.startswith("pipe-") else "local")
        self.instances[inst.instance_id] = inst
        return inst

    async def announce(self, ev: m.InstanceEvent) -> None:
        self.heard.append(ev)
        self.instances[ev.instance.instance_id] = ev.instance

    def report(self, inst: m.InstanceInfo) -> m.InstanceEvent:
        """A worker's instance event reaching the registry (the planner hears it only if the
        test passes it on): the registry times a scale-out's loaded instance."""
        self.instances[inst.instance_id] = inst
        op = self.ops.get(inst.scale_op_id or "")
        if op is not None and inst.loaded_at is not None:
            self.ops[op.scale_op_id] = op.model_copy(update={
                "timings": {**op.timings, f"loaded:{inst.instance_id}": inst.loaded_at}})
        return m.InstanceEvent(instance=inst)
