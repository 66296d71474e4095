"""Scale-operation parts travel to workers through a JetStream stream.

The planner publishes each worker its part of a scale-out (its TransferPart, its LoadModel) on
`subjects.worker_plan(worker_id)`; the stream (`subjects.PLAN_STREAM`) keeps it until the
worker's durable consumer acks it, at most PLAN_MAX_AGE_S. So a part survives a NATS reconnect
of the worker or the planner's death after sending it: the worker still carries it out, and a
restarted planner follows the instances it started (`PlannerService.resume_open_ops`).

The worker answers each part with the same CommandAck (or ErrorReply) an RPC would, on the
reply subject the planner names in the REPLY_HEADER. A part carries its deadline
(NOT_AFTER_HEADER): a worker that gets it later than that (the planner has already given up on
the answer and failed that target) acks it and does nothing, so no instance starts that nobody
follows. Publishing with `Nats-Msg-Id` makes a re-sent part a duplicate the stream drops.
"""

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from opentelemetry import context, propagate
from pydantic import BaseModel

from libs.protocol import subjects
from libs.bus.broker import parse_reply
from libs.protocol.messages import CommandAck, ErrorReply

log = logging.getLogger(__name__)

PLAN_MAX_AGE_S = 60.0  # a part nobody consumed within this is dropped by the stream
CONSUMER_ACK_WAIT_S = 30.0  # a part a worker took but never acked is delivered again after this
CONSUMER_IDLE_S = 600.0  # a worker gone this long loses its consumer (the stream stays bounded)
REPLY_HEADER = "Layercast-Reply-To"
NOT_AFTER_HEADER = "Layercast-Not-After"


def stream_config() -> StreamConfig:
    # Work-queue retention: an acked part is gone; each worker's consumer filters its own subject.
    return StreamConfig(name=subjects.PLAN_STREAM, subjects=[subjects.worker_plan("*")],
                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE,
                        max_age=PLAN_MAX_AGE_S, duplicate_window=PLAN_MAX_AGE_S)


async def ensure_plan_stream(nc: Any) -> None:
    """Create the stream, or bring an existing one to this configuration (idempotent)."""
    js = nc.jetstream()
    try:
        await js.add_stream(stream_config())
    except BadRequestError:
        await js.update_stream(stream_config())  # exists with other settings (an older version's)


async def send_part(nc: Any, worker_id: str, part: BaseModel, msg_id: str, timeout: float) -> CommandAck:
    """Publish `part` for `worker_id` and wait for its answer: the worker's CommandAck.

    Raises RemoteError when the worker answered with an error, TimeoutError when no answer came
    within `timeout` (the worker then drops the part: its deadline has passed)."""
    deadline = time.time() + timeout
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    try:
        headers = {REPLY_HEADER: inbox, NOT_AFTER_HEADER: repr(deadline), "Nats-Msg-Id": msg_id}
        propagate.inject(headers)  # the worker's handling joins the planner's trace
        subject = subjects.worker_plan(worker_id)
        await nc.jetstream().publish(subject, json.dumps(part.model_dump(mode="json")).encode(),
                                     headers=headers, timeout=max(deadline - time.time(), 0.001))
        try:
            msg = await sub.next_msg(timeout=max(deadline - time.time(), 0.001))
        except Exception as e:  # nats' own TimeoutError
            raise TimeoutError(f"no answer to {msg_id} from {worker_id} within {timeout}s") from e
    finally:
        await sub.unsubscribe()
    return parse_reply(subject, json.loads(msg.data), CommandAck)


async def consume_parts(nc: Any, worker_id: str, handle: Callable[[Any], Awaitable[dict]]) -> Any:
    """Subscribe `worker_id`'s durable consumer; `handle` is an `rpc`-wrapped handler (body ->
    reply dict). Parts are handled one at a time, in the order sent. Returns the subscription."""
    await ensure_plan_stream(nc)

    async def on_part(msg: Any) -> None:
        headers = msg.headers or {}
        not_after = headers.get(NOT_AFTER_HEADER)
        if not_after is not None and time.time() > float(not_after):
            log.warning("dropped a plan part that arrived after its deadline (%.1fs late)",
                        time.time() - float(not_after))
            await msg.ack()
            return
        token = context.attach(propagate.extract(headers))
        try:
            try:
                body = json.loads(msg.data)
            except ValueError as e:
                log.warning("rejected a plan part that is not JSON: %s", e)
                reply = ErrorReply(error=f"malformed plan part: {e}").model_dump(mode="json")
            else:
                reply = await handle(body)
        finally:
            context.detach(token)
        if reply_to := headers.get(REPLY_HEADER):
            await nc.publish(reply_to, json.dumps(reply).encode())
        await msg.ack()

    return await nc.jetstream().subscribe(
        subjects.worker_plan(worker_id), stream=subjects.PLAN_STREAM, durable=f"worker-{worker_id}",
        cb=on_part, manual_ack=True,
        config=ConsumerConfig(ack_wait=CONSUMER_ACK_WAIT_S, inactive_threshold=CONSUMER_IDLE_S))
