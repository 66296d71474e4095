"""The WorkerClient port's contract, held by both implementations: NatsWorkerClient against a worker
answering on real NATS as a worker's RPC does, and the in-memory fake the gateway's unit tests use.
The gateway's dispatch tells the outcomes apart by exactly these errors."""

import asyncio
import time
import uuid

import pytest

from libs.bus.broker import DomainError, NoResponders, RemoteError, make_broker, publish, rpc, start_broker
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import InMemoryWorkerClient, NatsWorkerClient


class _NatsWorkers:
    """Workers on NATS as the worker service answers generate and cancel, and the client to them."""

    def __init__(self, nats_url: str):
        self.broker = make_broker(nats_url)
        self.client = NatsWorkerClient(self.broker, gateway_id=f"gw-{uuid.uuid4().hex[:8]}")
        self.cancels: list[tuple[str, m.CancelRequest]] = []

    def add(self, worker_id: str, handler) -> None:
        self.broker.subscriber(subjects.worker_generate(worker_id))(rpc(m.GenerateRequest)(handler))

        async def cancel(msg: m.CancelRequest) -> None:
            self.cancels.append((worker_id, msg))
        self.broker.subscriber(subjects.worker_cancel(worker_id))(cancel)

    async def send(self, req: m.GenerateRequest, event: m.TokenEvent) -> None:
        await publish(self.broker, req.reply_subject, event)


class _InMemoryWorkers:
    def __init__(self):
        self.client = InMemoryWorkerClient()
        self.add = self.client.add

    @property
    def cancels(self) -> list[tuple[str, m.CancelRequest]]:
        return self.client.cancels

    async def send(self, req: m.GenerateRequest, event: m.TokenEvent) -> None:
        self.client.send(event)


@pytest.fixture(params=["nats", "in-memory"])
async def workers(request):
    if request.param == "in-memory":
        yield _InMemoryWorkers()
        return
    side = _NatsWorkers(request.getfixturevalue("nats_url"))
    yield side
    await side.broker.stop()


async def _started(workers) -> None:
    if isinstance(workers, _NatsWorkers):
        await start_broker(workers.broker)


def _request(client, request_id: str = "r1") -> m.GenerateRequest:
    return m.GenerateRequest(request_id=request_id, instance_id="i1", model="m", prompt_ids=[1, 2],
                             sampling=m.SamplingSpec(max_tokens=2, min_p=0.1, seed=3),
                             reply_subject=client.reply_subject(request_id))


async def test_an_accepted_request_reaches_the_worker_as_sent_and_its_tokens_come_back(workers):
    received, tokens = [], []

    async def generate(req: m.GenerateRequest) -> m.GenerateAccepted:
        received.append(req)
        await workers.send(req, m.TokenEvent(request_id=req.request_id, index=0, token_id=5, finished=True,
                                             finish_reason="length"))
        return m.GenerateAccepted(request_id=req.request_id, queued=1)

    worker = _add(workers, generate)
    workers.client.listen(tokens.append)
    await _started(workers)
    req = _request(workers.client)
    accepted = await workers.client.generate(worker, req, timeout_s=5)
    assert accepted == m.GenerateAccepted(request_id="r1", queued=1)
    assert received == [req]
    for _ in range(100):
        if tokens:
            break
        await asyncio.sleep(0.02)
    assert [(t.request_id, t.token_id, t.finished) for t in tokens] == [("r1", 5, True)]


async def test_a_refusal_is_a_remote_error_with_the_workers_code(workers):
    async def generate(req: m.GenerateRequest) -> m.GenerateAccepted:
        raise DomainError("taking it would break an SLO", code="busy")

    worker = _add(workers, generate)
    await _started(workers)
    with pytest.raises(RemoteError) as refused:
        await workers.client.generate(worker, _request(workers.client), timeout_s=5)
    assert refused.value.code == "busy" and "break an SLO" in refused.value.error


async def test_no_such_worker_is_no_responders(workers):
    await _started(workers)
    with pytest.raises(NoResponders):
        await workers.client.generate(f"w-gone-{uuid.uuid4().hex[:6]}", _request(workers.client), timeout_s=5)


async def test_a_worker_that_does_not_answer_in_time_is_a_plain_timeout(workers):
    answer = asyncio.Event()

    async def generate(req: m.GenerateRequest) -> m.GenerateAccepted:
        await answer.wait()
        return m.GenerateAccepted(request_id=req.request_id)

    worker = _add(workers, generate)
    await _started(workers)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as late:
        await workers.client.generate(worker, _request(workers.client), timeout_s=0.3)
    assert not isinstance(late.value, NoResponders)  # someone has it: it may still take it
    assert 0.25 <= time.monotonic() - started < 2
    answer.set()


async def test_a_cancel_reaches_the_worker(workers):
    async def generate(req: m.GenerateRequest) -> m.GenerateAccepted:
        return m.GenerateAccepted(request_id=req.request_id)

    worker = _add(workers, generate)
    await _started(workers)
    cancel = m.CancelRequest(request_id="r1", instance_id="i1", attempt=2)
    await workers.client.cancel(worker, cancel)
    for _ in range(100):
        if workers.cancels:
            break
        await asyncio.sleep(0.02)
    assert workers.cancels == [(worker, cancel)]


def _add(workers, handler) -> str:
    worker = f"w-{uuid.uuid4().hex[:6]}"
    workers.add(worker, handler)
    return worker
