"""What the planner needs from the registry, as a port: the `ClusterRegistry` protocol and its
NATS implementation (RPCs to the registry service, instance events on the bus).

The planner service is built on this port and on `libs.bus.worker_commands.WorkerCommands`, so
it can be constructed and driven without NATS (tests/unit/planner use in-memory fakes).
Failures raise TimeoutError or RemoteError, as the NATS calls do.
"""

from typing import Protocol

from faststream.nats import NatsBroker

from libs.bus.broker import call, publish
from libs.protocol import messages as m
from libs.protocol import subjects


class ClusterRegistry(Protocol):
    async def cluster(self, recent_scale_ops: int = 0) -> m.ClusterView:
        """The registry's view of the cluster, with this many recent scale operations."""
        ...

    async def record(self, op: m.ScaleOpInfo) -> None:
        """Write a scale operation's record (created, or updated: state, plan, timings)."""
        ...

    async def create_instance(self, req: m.CreateInstance) -> m.InstanceInfo:
        ...

    async def announce(self, ev: m.InstanceEvent) -> None:
        """Publish an instance event (the registry records it, the gateway routes by it)."""
        ...


class NatsClusterRegistry:
    def __init__(self, broker: NatsBroker, timeout_s: float = 5.0):
        self.broker = broker
        self.timeout_s = timeout_s

    async def cluster(self, recent_scale_ops: int = 0) -> m.ClusterView:
        return await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=recent_scale_ops),
                          m.ClusterView, timeout=self.timeout_s)

    async def record(self, op: m.ScaleOpInfo) -> None:
        await call(self.broker, subjects.REGISTRY_SCALEOP_RECORD, m.RecordScaleOp(**op.model_dump()), m.ScaleOpInfo)

    async def create_instance(self, req: m.CreateInstance) -> m.InstanceInfo:
        return await call(self.broker, subjects.REGISTRY_INSTANCE_CREATE, req, m.InstanceInfo)

    async def announce(self, ev: m.InstanceEvent) -> None:
        await publish(self.broker, subjects.EVENT_INSTANCE, ev)
