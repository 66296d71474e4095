"""Planner -> worker commands as a port: the `WorkerCommands` protocol and its NATS implementation.

A part of a plan (a TransferPart, a LoadModel) goes through the JetStream plan stream
(`libs/bus/plans.py`: it survives a reconnect or the planner's death); any other command
(unload, fetch, release, cancel, start a pipeline) as an RPC. Which one a command takes is the
caller's decision (`libs.planning.scaleop.plan_part_id`); the port only carries it.

Both methods answer None once the worker accepted, else why not (refused, gone, silent):
a worker's refusal is an outcome the planner plans with, not an exception.
"""

from typing import Protocol

from faststream.nats import NatsBroker

from libs.bus.broker import RemoteError, call
from libs.bus.plans import send_part
from libs.protocol import messages as m
from libs.protocol import subjects


class WorkerCommands(Protocol):
    async def send_part(self, worker_id: str, part: m.Message, part_id: str) -> str | None:
        """Publish a part of a plan on the worker's plan stream under message id `part_id` (the
        stream drops an id it has seen) and wait for the worker's answer."""
        ...

    async def command(self, worker_id: str, cmd: m.Message) -> str | None:
        """Send the worker any other command as an RPC and wait for its answer."""
        ...


class NatsWorkerCommands:
    """WorkerCommands over NATS: the plan stream for parts, `worker.<id>.command` RPCs for the rest."""

    def __init__(self, broker: NatsBroker, timeout_s: float = 5.0):
        self.broker = broker
        self.timeout_s = timeout_s

    async def send_part(self, worker_id: str, part: m.Message, part_id: str) -> str | None:
        try:
            ack = await send_part(self.broker._connection, worker_id, part, part_id, self.timeout_s)
        except (TimeoutError, RemoteError) as e:
            return str(e)
        return None if ack.accepted else ack.detail or "refused"

    async def command(self, worker_id: str, cmd: m.Message) -> str | None:
        try:
            ack = await call(self.broker, subjects.worker_command(worker_id), cmd, m.CommandAck,
                             timeout=self.timeout_s)
        except (TimeoutError, RemoteError) as e:
            return str(e)
        return None if ack.accepted else ack.detail or "refused"
