"""Execute while loading inside one instance, on a real worker (real NATS, Postgres, a paced
load from the checkpoint): requests that reach a serve-while-loading instance before its last
block run their prefill through the blocks already landed (the engine thread's
`prefill_ahead`), and get exactly the greedy tokens of the model loaded whole, none before
the last block is in."""

import asyncio
import time

from libs.bus.broker import call
from libs.checkpoint import CheckpointIndex
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import NatsWorkerClient
from services.worker import runtime
from services.worker.service import WorkerConfig, WorkerService
from test_live_pair_e2e import MAX_TOKENS, PROMPTS, alone
from test_registry import client, collect, started  # noqa: F401 - the client fixture
from test_worker_unload import of_instance, until

LOAD_S = 4.0  # the paced load: the instance serves from its first block, the last lands seconds later


async def test_requests_that_reach_a_loading_instance_prefill_through_its_landed_blocks(
        database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    expected = await asyncio.to_thread(alone, tiny_checkpoint)
    seen: list[m.InstanceEvent] = []
    subs = [await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)]
    reg = await started(database_url, nats_url)
    worker = WorkerService(WorkerConfig(worker_id="w-ahead", kv_cache_bytes=8 << 20,
                                        emulated_host_to_device_mbit=total * 8 / 1e6 / LOAD_S), nats_url)
    await worker.start()
    tokens: dict[str, _Stamped] = {}
    first_token_at: dict[str, float] = {}
    try:
        command = subjects.worker_command("w-ahead")
        load = m.LoadModel(instance_id="i-ahead", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=index.n_blocks, serve_while_loading=True)
        assert (await call(client, command, load, m.CommandAck)).accepted
        await until(lambda: any(ev.instance.state == m.InstanceState.ready for ev in of_instance(seen, "i-ahead")),
                    LOAD_S * 2)
        assert not any(ev.instance.loaded_at for ev in of_instance(seen, "i-ahead")), "loaded before the test sent"
        ran_ahead = runtime.PREFILL_AHEAD._value.get()
        gateway = NatsWorkerClient(client, gateway_id="gw-ahead")
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            tokens[rid] = _Stamped(rid, first_token_at)
            subs.append(await collect(client, subjects.tokens("gw-ahead", rid), m.TokenEvent, tokens[rid]))
            await gateway.generate("w-ahead", m.GenerateRequest(
                request_id=rid, instance_id="i-ahead", model="demo", prompt_ids=prompt,
                sampling=m.SamplingSpec(temperature=0, max_tokens=MAX_TOKENS),
                reply_subject=gateway.reply_subject(rid)), timeout_s=5.0)

        def finished() -> bool:
            return all(any(t.finished for t in tokens.get(f"r{i}", [])) for i in range(len(PROMPTS)))
        await until(finished, LOAD_S * 4)
        loaded_at = next(ev.instance.loaded_at for ev in of_instance(seen, "i-ahead") if ev.instance.loaded_at)
    finally:
        for s in subs:
            await s.stop()
        await worker.stop()
        await reg.stop()

    got = [[t.token_id for t in tokens[f"r{i}"] if t.token_id is not None] for i in range(len(PROMPTS))]
    assert got == expected and all(t.error is None for ts in tokens.values() for t in ts)
    # Their prefills ran ahead of the load: the first block (of two) before the last landed.
    assert runtime.PREFILL_AHEAD._value.get() - ran_ahead >= 1
    # ... and no token came before the model was whole (a small allowance for the two clocks' events).
    assert min(first_token_at.values()) >= loaded_at - 0.05, (first_token_at, loaded_at)


class _Stamped(list):
    """The token events of one request, noting when its first one came."""

    def __init__(self, request_id: str, first_at: dict[str, float]):
        super().__init__()
        self.request_id, self.first_at = request_id, first_at

    def append(self, event) -> None:
        super().append(event)
        self.first_at.setdefault(self.request_id, time.time())
