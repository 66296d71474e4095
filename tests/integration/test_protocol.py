"""The message contract: validation, versions, subjects."""

import pytest
from pydantic import ValidationError

from libs.protocol import messages as m
from libs.protocol import subjects


def test_worker_commands_are_told_apart_by_op():
    load = m.WorkerCommand.model_validate({"op": "load", "instance_id": "i", "model": "x", "path": "/p",
                                           "block_start": 0, "block_end": 2})
    unload = m.WorkerCommand.model_validate({"op": "unload", "instance_id": "i"})
    assert isinstance(load.root, m.LoadModel) and isinstance(unload.root, m.UnloadModel)
    with pytest.raises(ValidationError):
        m.WorkerCommand.model_validate({"op": "explode", "instance_id": "i"})


def test_unknown_versions_and_bad_fields_are_rejected_unknown_fields_ignored():
    good = {"model": "x", "desired_instances": 1, "reason": "r"}
    assert m.ScaleRequest.model_validate({**good, "future_field": 1}).version == 1
    with pytest.raises(ValidationError):
        m.ScaleRequest.model_validate({**good, "version": 2})
    with pytest.raises(ValidationError):
        m.ScaleRequest.model_validate({**good, "desired_instances": -1})
    with pytest.raises(ValidationError):
        m.RegisterWorker.model_validate({"worker_id": "a.b", "data_address": "h:1",
                                         "topology": {"host": "h"}, "capacities": {}})


def test_subjects_live_under_the_namespace():
    names = [v for k, v in vars(subjects).items() if k.isupper() and isinstance(v, str)
             and k not in ("PREFIX", "PLAN_STREAM")]
    names += [subjects.worker_command("w"), subjects.worker_plan("w"), subjects.worker_peer("w"),
              subjects.tokens("g", "r"),
              subjects.tokens_wildcard("g")]
    assert all(n.startswith(subjects.PREFIX + ".") for n in names)
    assert len(set(names)) == len(names)
    # A stream's name is one token (no dots), still the namespace's own.
    assert subjects.PLAN_STREAM == f"{subjects.PREFIX}-plans"


async def test_a_request_waits_briefly_for_a_responder_that_is_still_subscribing(nats_url):
    import asyncio
    import time

    from libs.bus.broker import NO_RESPONDER_GRACE_S, call, make_broker, rpc, start_broker

    client, server = make_broker(nats_url), make_broker(nats_url)
    await start_broker(client)
    subject = f"{subjects.PREFIX}.test.late-responder"

    @server.subscriber(subject)
    @rpc(m.ModelRef)
    async def answer(req: m.ModelRef) -> m.CommandAck:
        return m.CommandAck(accepted=True, detail=req.name)

    async def start_late() -> None:
        await asyncio.sleep(NO_RESPONDER_GRACE_S / 3)
        await start_broker(server)

    try:
        starter = asyncio.create_task(start_late())
        ack = await call(client, subject, m.ModelRef(name="hello"), m.CommandAck, timeout=5)
        assert ack.detail == "hello"
        await starter
        # Nobody will ever answer here: "no responders" fails after the grace, not the timeout.
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await call(client, f"{subjects.PREFIX}.test.nobody", m.ModelRef(name="x"), m.CommandAck, timeout=5)
        assert time.monotonic() - t0 < NO_RESPONDER_GRACE_S + 1.0
    finally:
        await server.stop()
        await client.stop()
