"""A `blitzscale` scale-out forms a live pair by itself (BlitzScale §5.2), against real NATS,
Postgres, the planner service and three workers: the pool's copy goes off the serving worker, the
scale-out to three instances loads one target from that copy and sends the other its blocks by
chain; the planner pairs the serving instance with that chain target (FormLivePair, target first),
the requests sent to the source meanwhile run their first block on the target, every request is
answered with the instance alone's tokens, and the pair dissolves at the target's last block."""

import asyncio
from collections.abc import Sequence

from libs.bus.broker import call
from libs.checkpoint import CheckpointIndex
from libs.planning import scaleop as so
from libs.planning.instance import Phase
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import NatsWorkerClient
from services.planner.service import PlannerService
from services.worker.service import WorkerConfig, WorkerService
from test_live_pair_e2e import MAX_TOKENS, PROMPTS, alone
from test_registry import client, collect, started  # noqa: F401 - the client fixture
from test_worker_unload import until

LOAD_S = 6.0  # every worker's paced copy into engine memory: a target's first block lands about halfway
WORKERS = ("w-a", "w-b", "w-c")


async def view_of(client) -> m.ClusterView:  # noqa: F811
    return await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=20), m.ClusterView)


async def deploy_and_pair(client, planner: PlannerService, index: CheckpointIndex, tiny_checkpoint,  # noqa: F811
                          workers: dict[str, WorkerService], max_instances: int, start_later: Sequence[str] = ()):
    """Deploy `demo` in mode blitzscale, serve it on one worker, let the pool keep a copy off
    that worker, then scale out to three: the planner pairs the serving instance with its chain
    target. Returns the serving instance, the operation and the pair, once both sides are paired.
    The workers in `start_later` start once the first instance serves (so it is not on them)."""
    # A TTFT SLO shorter than any load: every chain target is worth pairing (criterion (1)).
    await call(client, subjects.REGISTRY_MODEL_DEPLOY, m.DeployModel(
        name="demo", path=str(tiny_checkpoint), arch=index.arch, n_layers=index.n_layers,
        blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                            layer_end=b.layer_end) for b in index.blocks],
        min_instances=0, max_instances=max_instances, scaling_mode="blitzscale", ttft_slo_s=1e-3), m.ModelInfo)

    await planner.reconcile(m.ScaleRequest(model="demo", desired_instances=1, reason="first request"))
    for _ in range(200):
        if first := await ready_loaded(client):
            break
        await asyncio.sleep(0.1)
    (source,) = first
    for w in start_later:
        await workers[w].start()
    # The pool keeps a copy off the serving worker (its periodic check): one more host copy.
    for _ in range(200):
        await planner.check_pool()
        if len(await host_copies(client, index.n_blocks)) >= 2:
            break
        await asyncio.sleep(0.1)
    assert len(await host_copies(client, index.n_blocks)) == 2

    op = await planner.reconcile(m.ScaleRequest(model="demo", desired_instances=3, reason="load past the bound"))
    assert op is not None and op.plan["algorithm"] == "chain"
    (planned,) = op.plan["live_pairs"]
    assert planned["source_instance"] == source.instance_id
    assert planned["target_worker"] in op.plan["receivers"]  # receiving by chain, not loading a copy of its own
    tgt, src = workers[planned["target_worker"]], workers[source.entry_worker]
    (pair,) = so.open_live_pairs(planner.ops.values())
    target = pair.target_instance
    await until(lambda: tgt.loading.lifecycles.get(target) is not None
                and tgt.loading.lifecycles[target].phase is Phase.pair_target, 10)
    assert tgt.loading.lifecycles[target].phase is Phase.pair_target
    assert src.loading.lifecycles[source.instance_id].phase is Phase.pair_source
    return source, op, pair


async def ready_loaded(client) -> list[m.InstanceInfo]:  # noqa: F811
    return [i for i in (await view_of(client)).instances
            if i.state == m.InstanceState.ready and i.loaded_at is not None]


async def host_copies(client, n_blocks: int) -> set[str]:  # noqa: F811
    """Workers holding every block in host memory."""
    held: dict[str, int] = {}
    for r in (await view_of(client)).replicas:
        if r.tier == m.Tier.host and r.state == m.ReplicaState.ready:
            held[r.worker_id] = held.get(r.worker_id, 0) + 1
    return {w for w, n in held.items() if n == n_blocks}


async def test_a_blitzscale_scale_out_pairs_the_serving_instance_with_its_chain_target_and_dissolves_it(
        database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    expected = await asyncio.to_thread(alone, tiny_checkpoint)
    reg = await started(database_url, nats_url)
    workers = {w: WorkerService(WorkerConfig(worker_id=w, kv_cache_bytes=8 << 20,
                                             emulated_host_to_device_mbit=total * 8 / 1e6 / LOAD_S), nats_url)
               for w in WORKERS}
    for w in workers.values():
        await w.start()
    planner = PlannerService(nats_url)
    await planner.start()
    tokens: dict[str, list[m.TokenEvent]] = {}
    subs = []
    try:
        source, op, pair = await deploy_and_pair(client, planner, index, tiny_checkpoint, workers, max_instances=3)
        target = pair.target_instance
        tgt, src = workers[pair.target_worker], workers[source.entry_worker]
        front, splitter = tgt.livepairs.fronts[target], src.livepairs.splitters[source.instance_id]

        # The load is still on its way: requests to the source split their prefills.
        await until(lambda: 0 in tgt.loading.lifecycles[target].in_engine, LOAD_S)
        gateway = NatsWorkerClient(client, gateway_id="gw-blitz")
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            into = tokens.setdefault(rid, [])
            subs.append(await collect(client, subjects.tokens("gw-blitz", rid), m.TokenEvent, into))
            await gateway.generate(source.entry_worker, m.GenerateRequest(
                request_id=rid, instance_id=source.instance_id, model="demo", prompt_ids=prompt,
                sampling=m.SamplingSpec(temperature=0, max_tokens=MAX_TOKENS),
                reply_subject=gateway.reply_subject(rid)), timeout_s=5.0)

        def finished() -> bool:
            return all(any(t.finished for t in tokens.get(f"r{i}", [])) for i in range(len(PROMPTS)))
        await until(finished, 30)
        got = [[t.token_id for t in tokens[f"r{i}"] if t.token_id is not None] for i in range(len(PROMPTS))]
        assert got == expected and all(t.error is None for ts in tokens.values() for t in ts)
        assert 1 in splitter.splits and front.passes >= 1  # a prefill's first block ran on the target

        # The target's last block: the pair dissolves, the operation closes with three instances.
        async def closed() -> m.ScaleOpInfo | None:
            rec = next(o for o in (await view_of(client)).scale_ops if o.scale_op_id == op.scale_op_id)
            return rec if rec.state == "done" else None
        for _ in range(300):
            if record := await closed():
                break
            await asyncio.sleep(0.1)
        assert record is not None and record.timings.get(f"paired:{target}") is not None
        assert record.timings[f"paired:{target}"] <= record.timings[f"unpaired:{target}"]
        assert so.open_live_pairs(planner.ops.values()) == []
        await until(lambda: src.loading.lifecycles[source.instance_id].phase is Phase.serving, 10)
        assert src.loading.lifecycles[source.instance_id].phase is Phase.serving
        assert tgt.loading.lifecycles[target].phase is Phase.serving and not tgt.livepairs.fronts
        for _ in range(100):  # the registry hears of the last instance's load a moment after the op closes
            if len(await ready_loaded(client)) == 3:
                break
            await asyncio.sleep(0.1)
        assert len(await ready_loaded(client)) == 3
    finally:
        for s in subs:
            await s.stop()
        await planner.stop()
        for w in workers.values():
            await w.stop()
        await reg.stop()



async def test_a_scale_out_during_a_live_pair_sends_nothing_from_the_pairs_workers(
        database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    """Issue 38's "a source serving a live pair is never chosen as a chain source while another
    source exists", with real processes: while the pair of a first scale-out is open, a second
    one (to four, onto w-d) sends from the pool's copy, not from the pair's source (whose link
    carries the pair's hidden states and KV) nor its target. Without the pruning the chain would
    start at the serving copy, the pair's source (checked once by turning
    libs.planning.scaleout.live_pair_workers off: this test then fails on the sources)."""
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    reg = await started(database_url, nats_url)
    reports: list[m.TransferReport] = []
    sub = await collect(client, subjects.EVENT_TRANSFER, m.TransferReport, reports)
    # Paced loads keep the first scale-out's pair open while the second one is planned.
    workers = {w: WorkerService(WorkerConfig(worker_id=w, kv_cache_bytes=8 << 20,
                                             emulated_host_to_device_mbit=total * 8 / 1e6 / LOAD_S), nats_url)
               for w in (*WORKERS, "w-d")}
    # w-a serves first (the others start after): the pair's source is then the copy that sorts
    # first among the second scale-out's sources, the one it would take without the pruning.
    await workers["w-a"].start()
    planner = PlannerService(nats_url)
    await planner.start()
    try:
        source, first_op, pair = await deploy_and_pair(client, planner, index, tiny_checkpoint, workers,
                                                       max_instances=4, start_later=("w-b", "w-c", "w-d"))
        assert pair.source_worker == "w-a"
        op = await planner.reconcile(m.ScaleRequest(model="demo", desired_instances=4, reason="more load"))
        assert so.open_live_pairs(planner.ops.values()), "the first pair ended before the second scale-out was planned"
        assert op is not None and op.plan["kind"] == "multicast" and op.plan["sources"], op.plan
        (target,) = op.plan["targets"]
        assert target not in first_op.plan["targets"] and target != "w-a", (first_op.plan, op.plan)
        pair_workers = {pair.source_worker, pair.target_worker}
        assert not pair_workers & set(op.plan["sources"]), op.plan
        # The target gets the model, every byte from a copy outside the pair.
        await until(lambda: any(r.scale_op_id == op.scale_op_id and r.worker_id == target for r in reports), 30)
        ours = [r for r in reports if r.scale_op_id == op.scale_op_id]
        assert {r.worker_id: r.bytes_received for r in ours if r.bytes_received} == {target: total}, ours
        sent = {r.worker_id: r.bytes_sent for r in ours if r.bytes_sent}
        assert sent and not pair_workers & set(sent), ours
    finally:
        await planner.stop()
        for w in workers.values():
            await w.stop()
        await reg.stop()
        await sub.stop()
