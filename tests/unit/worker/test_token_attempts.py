"""A request handed over back to the instance it runs on (a NATS restart lost its tokens) runs
there as a new attempt: the engine knows each attempt by its own run id, so a step of the old
attempt that finished after the new one was registered is dropped, not sent as the new
attempt's next token; every token event says the attempt that made it (the gateway drops
those of an attempt it left). On real NATS, the worker's own broker and publishing code."""

import asyncio

from opentelemetry import trace

from libs.bus.broker import start_broker
from libs.engine.engine import TokenOutput
from libs.protocol import messages as m
from services.worker.service import WorkerConfig, WorkerService, _Request, run_id, split_run_id


def output(run: str, token: int) -> TokenOutput:
    return TokenOutput(request_id=run, token_id=token, finished=False, finish_reason=None, prompt_tokens=2,
                       completion_tokens=1)


async def test_a_step_of_the_attempt_a_request_left_is_not_sent_as_the_new_attempts_token(nats_url):
    worker = WorkerService(WorkerConfig("w-attempts"), nats_url)
    got: list[m.TokenEvent] = []
    subject = "test.tokens.attempts"
    sub = worker.broker.subscriber(subject)

    @sub
    async def on_token(body: dict) -> None:
        got.append(m.TokenEvent.model_validate(body))

    await start_broker(worker.broker)
    try:
        # Attempt 1 on instance "a" resumes after 2 tokens; attempt 0's engine run was still going.
        worker.requests["r"] = _Request("a", "m", "local", subject, trace.INVALID_SPAN, next_index={0: 2},
                                        attempt=1, run=run_id("r", 1))
        await worker._publish_outputs([("a", run_id("r", 0), output(run_id("r", 0), 9), None),
                                       ("a", run_id("r", 1), output(run_id("r", 1), 2), None)])
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # (anything else sent would be here by now)
    finally:
        await worker.broker.stop()
    assert [(e.index, e.token_id, e.attempt, e.instance_id) for e in got] == [(2, 2, 1, "a")]


def test_run_ids_round_trip():
    assert split_run_id(run_id("abc123", 7)) == ("abc123", 7)
    assert split_run_id("no-attempt") == ("no-attempt", None)
