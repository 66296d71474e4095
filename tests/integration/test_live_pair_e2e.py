"""A live pair between two workers (BlitzScale §5.2) over real NATS and the real data plane:
a worker still loading the model (paced, stop-the-world) lends its first block to an
overloaded worker's prefills, the requests get the greedy tokens of the instance alone, and
the pair dissolves by itself when the loader holds every block (it then serves on its own)."""

import asyncio

from libs.bus.broker import call
from libs.checkpoint import CheckpointIndex
from libs.engine import Engine, SamplingSpec
from libs.planning.instance import Phase
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import NatsWorkerClient
from services.worker.livepairs import front_id
from services.worker.service import WorkerConfig, WorkerService
from test_registry import client, collect, started  # noqa: F401 - the client fixture
from test_worker_unload import of_instance, until

LOAD_S = 8.0  # the target's paced load: its first block lands about halfway
PROMPTS = [[1, 17, 200, 45, 301, 99, 7, 450, 12, 64], [5, 6, 7], [300, 2, 9, 44, 81, 7, 120]]
MAX_TOKENS = 8


def alone(path) -> list[list[int]]:
    engine = Engine.from_checkpoint(path, max_batch_size=4, max_seq_len=128)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingSpec(temperature=0, max_tokens=MAX_TOKENS))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


async def test_a_live_pair_serves_the_instances_tokens_and_dissolves_at_the_loaders_last_block(
        database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    expected = await asyncio.to_thread(alone, tiny_checkpoint)
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    tokens: dict[str, list[m.TokenEvent]] = {}
    token_subs = []
    reg = await started(database_url, nats_url)
    src = WorkerService(WorkerConfig(worker_id="w-src", kv_cache_bytes=8 << 20), nats_url)
    tgt = WorkerService(WorkerConfig(worker_id="w-tgt", kv_cache_bytes=8 << 20,
                                     emulated_host_to_device_mbit=total * 8 / 1e6 / LOAD_S), nats_url)
    for w in (src, tgt):
        await w.start()

    def loaded(iid: str) -> bool:
        return any(ev.instance.loaded_at for ev in of_instance(seen, iid))

    async def generate(worker: str, instance: str, rid: str, prompt: list[int]) -> None:
        into = tokens.setdefault(rid, [])
        token_subs.append(await collect(client, subjects.tokens("gw-pair", rid), m.TokenEvent, into))
        gateway = NatsWorkerClient(client, gateway_id="gw-pair")
        await gateway.generate(worker, m.GenerateRequest(
            request_id=rid, instance_id=instance, model="demo", prompt_ids=prompt,
            sampling=m.SamplingSpec(temperature=0, max_tokens=MAX_TOKENS), reply_subject=gateway.reply_subject(rid)),
            timeout_s=5.0)

    def finished(rid: str) -> bool:
        return any(t.finished for t in tokens.get(rid, []))

    try:
        load = m.LoadModel(instance_id="i-src", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=index.n_blocks)
        assert (await call(client, subjects.worker_command("w-src"), load, m.CommandAck)).accepted
        await until(lambda: loaded("i-src"), 30)
        # The loader: stop-the-world (it serves nothing alone until every block is in).
        load = m.LoadModel(instance_id="i-tgt", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=index.n_blocks, serve_while_loading=False)
        assert (await call(client, subjects.worker_command("w-tgt"), load, m.CommandAck)).accepted
        form = m.FormLivePair(model="demo", path=str(tiny_checkpoint), source_instance="i-src", source_worker="w-src",
                              target_instance="i-tgt", target_worker="w-tgt",
                              peers={w.config.worker_id: w.transport.address for w in (src, tgt)})
        for worker in ("w-tgt", "w-src"):  # the target's front first, as a pipeline's later stages
            ack = await call(client, subjects.worker_command(worker), form, m.CommandAck)
            assert ack.accepted and ack.detail == "paired", ack
        assert src.loading.lifecycles["i-src"].phase is Phase.pair_source
        assert tgt.loading.lifecycles["i-tgt"].phase is Phase.pair_target
        front, splitter = tgt.livepairs.fronts["i-tgt"], src.livepairs.splitters["i-src"]

        await until(lambda: 0 in tgt.loading.lifecycles["i-tgt"].in_engine, LOAD_S)
        assert not loaded("i-tgt"), "the paced load ended before the pair could work"
        for i, p in enumerate(PROMPTS):
            await generate("w-src", "i-src", f"r{i}", p)
        await until(lambda: all(finished(f"r{i}") for i in range(len(PROMPTS))), 30)
        assert not loaded("i-tgt"), "the requests ran after the pair dissolved: nothing was split"
        got = [[t.token_id for t in tokens[f"r{i}"] if t.token_id is not None] for i in range(len(PROMPTS))]
        assert got == expected
        assert all(t.error is None for ts in tokens.values() for t in ts)
        # The prefills ran their first block on the loader, the rest and every decode on the source.
        assert 1 in splitter.splits and front.passes >= 1

        # The loader's last block: the pair dissolves, the loader serves alone, the source unpairs.
        await until(lambda: loaded("i-tgt"), LOAD_S * 2)
        await until(lambda: src.loading.lifecycles["i-src"].phase is Phase.serving, 10)
        assert src.loading.lifecycles["i-src"].phase is Phase.serving
        assert tgt.loading.lifecycles["i-tgt"].phase is Phase.serving
        assert front_id("i-tgt") not in tgt.pipelines.server.stages and not tgt.livepairs.fronts
        assert not src.livepairs.splitters
        await generate("w-tgt", "i-tgt", "after", PROMPTS[0])
        await until(lambda: finished("after"), 30)
        assert [t.token_id for t in tokens["after"] if t.token_id is not None] == expected[0]
    finally:
        await sub.stop()
        for s in token_subs:
            await s.stop()
        for w in (src, tgt):
            await w.stop()
        await reg.stop()


async def test_a_pair_whose_loader_dies_leaves_the_source_serving_alone_with_the_same_tokens(
        database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    """The loader's worker goes away mid-pair (no unload, no notice): the source's next split
    call fails, the pass runs there, its lifecycle learns it (PairLost) and it serves alone."""
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    expected = await asyncio.to_thread(alone, tiny_checkpoint)
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    tokens: dict[str, list[m.TokenEvent]] = {}
    token_subs = []
    reg = await started(database_url, nats_url)
    src = WorkerService(WorkerConfig(worker_id="w-src2", kv_cache_bytes=8 << 20), nats_url)
    tgt = WorkerService(WorkerConfig(worker_id="w-tgt2", kv_cache_bytes=8 << 20,
                                     emulated_host_to_device_mbit=total * 8 / 1e6 / LOAD_S), nats_url)
    for w in (src, tgt):
        await w.start()
    stopped = False
    try:
        load = m.LoadModel(instance_id="i-src2", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=index.n_blocks)
        assert (await call(client, subjects.worker_command("w-src2"), load, m.CommandAck)).accepted
        await until(lambda: any(ev.instance.loaded_at for ev in of_instance(seen, "i-src2")), 30)
        load = m.LoadModel(instance_id="i-tgt2", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=index.n_blocks, serve_while_loading=False)
        assert (await call(client, subjects.worker_command("w-tgt2"), load, m.CommandAck)).accepted
        form = m.FormLivePair(model="demo", path=str(tiny_checkpoint), source_instance="i-src2",
                              source_worker="w-src2", target_instance="i-tgt2", target_worker="w-tgt2",
                              peers={w.config.worker_id: w.transport.address for w in (src, tgt)})
        for worker in ("w-tgt2", "w-src2"):
            assert (await call(client, subjects.worker_command(worker), form, m.CommandAck)).accepted
        await tgt.stop()  # gone without a word
        stopped = True
        gateway = NatsWorkerClient(client, gateway_id="gw-pair2")
        for i, p in enumerate(PROMPTS):
            rid = f"d{i}"
            token_subs.append(await collect(client, subjects.tokens("gw-pair2", rid), m.TokenEvent,
                                            tokens.setdefault(rid, [])))
            await gateway.generate("w-src2", m.GenerateRequest(
                request_id=rid, instance_id="i-src2", model="demo", prompt_ids=p,
                sampling=m.SamplingSpec(temperature=0, max_tokens=MAX_TOKENS),
                reply_subject=gateway.reply_subject(rid)), timeout_s=5.0)
        await until(lambda: all(any(t.finished for t in tokens[f"d{i}"]) for i in range(len(PROMPTS))), 60)
        got = [[t.token_id for t in tokens[f"d{i}"] if t.token_id is not None] for i in range(len(PROMPTS))]
        assert got == expected
        assert all(t.error is None for ts in tokens.values() for t in ts)
        await until(lambda: src.loading.lifecycles["i-src2"].phase is Phase.serving, 10)
        assert src.loading.lifecycles["i-src2"].phase is Phase.serving and not src.livepairs.splitters
        engine = src.runtime.engine_of("i-src2")  # (read after its steps: nothing runs on it now)
        assert not engine.paired and engine.pair_error  # the failed call, not an EndLivePair, ended it
    finally:
        await sub.stop()
        for s in token_subs:
            await s.stop()
        for w in (src,) if stopped else (src, tgt):
            await w.stop()
        await reg.stop()
