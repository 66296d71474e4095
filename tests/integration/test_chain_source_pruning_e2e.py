"""A `chain` scale-out sends nothing from a source whose egress serves an execution pipeline
while another source exists (BlitzScale §4, Fig. 8; issue 38), on a running cluster: real
NATS, the real Postgres registry, the real planner service, real workers and block transfers
(in process).

Model `tiny` (two blocks, mode `chain`): w-a and w-c each serve a local instance and hold a
host copy; w-b holds an idle host copy (a pool copy); w-t1 and w-t2 are free. With the
pipeline, w-a and w-c also run the two stages of an execution pipeline of `tiny` (started by
StartPipeline, as the planner does during a layercast multicast). The scale-out to five then
loads w-b from its own copy and sends the blocks to w-t1 and w-t2: with the pipeline only w-b
may send; without it (the control) the chains start at the serving copies, w-a among them."""

import asyncio

import pytest

from libs.bus.broker import call, publish
from libs.checkpoint import CheckpointIndex
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import NatsWorkerClient
from services.planner.service import PlannerService
from services.worker.service import WorkerConfig, WorkerService
from test_registry import client, collect, started  # noqa: F401 - the client fixture
from test_worker_unload import until

MODEL = "tiny"
A, B, C, T1, T2 = "w-a", "w-b", "w-c", "w-t1", "w-t2"
PIPELINE = "p-a-c"


async def view(client) -> m.ClusterView:  # noqa: F811
    return await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)


async def until_view(client, condition, timeout_s: float, what: str) -> m.ClusterView:  # noqa: F811
    """Poll the registry's view until `condition(view)` holds; fail with `what` after the timeout."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        v = await view(client)
        if condition(v):
            return v
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: "
                                 f"{[(i.instance_id, i.mode, i.state.value, i.loaded_at) for i in v.instances]} "
                                 f"{[(o.direction, o.state, o.plan) for o in v.scale_ops]}")
        await asyncio.sleep(0.1)


async def generate(client, worker: str, instance: str, request_id: str) -> list[m.TokenEvent]:  # noqa: F811
    """A short greedy request straight to `instance` on `worker` (as the gateway sends it); its tokens."""
    tokens: list[m.TokenEvent] = []
    sub = await collect(client, subjects.tokens("gw-prune", request_id), m.TokenEvent, tokens)
    try:
        gateway = NatsWorkerClient(client, gateway_id="gw-prune")
        await gateway.generate(worker, m.GenerateRequest(
            request_id=request_id, instance_id=instance, model=MODEL, prompt_ids=[1, 17, 200, 45],
            sampling=m.SamplingSpec(temperature=0, max_tokens=4), reply_subject=gateway.reply_subject(request_id)),
            timeout_s=5.0)
        await until(lambda: any(t.finished for t in tokens), 30)
    finally:
        await sub.stop()
    return tokens


def host_copies(v: m.ClusterView, n_blocks: int) -> set[str]:
    held: dict[str, set[int]] = {}
    for r in v.replicas:
        if r.model == MODEL and r.tier == m.Tier.host and r.state == m.ReplicaState.ready:
            held.setdefault(r.worker_id, set()).add(r.block_id)
    return {w for w, blocks in held.items() if len(blocks) == n_blocks}


def loaded_local(v: m.ClusterView) -> dict[str, m.InstanceInfo]:
    """worker -> its loaded, ready local instance of the model."""
    return {i.stages[0].worker_id: i for i in v.instances if i.model == MODEL and i.mode == "local"
            and i.state == m.InstanceState.ready and i.loaded_at is not None}


@pytest.mark.parametrize("pipeline", [True, False], ids=["a-serves-a-pipeline", "control-no-pipeline"])
async def test_a_chain_scale_out_sends_nothing_from_a_source_serving_a_pipeline_while_another_source_exists(
        database_url, nats_url, client, tiny_checkpoint, pipeline):  # noqa: F811
    index = CheckpointIndex.load(tiny_checkpoint)
    n_blocks = index.n_blocks
    model_bytes = sum(index.block(b).nbytes for b in range(n_blocks))
    reports: list[m.TransferReport] = []
    sub = await collect(client, subjects.EVENT_TRANSFER, m.TransferReport, reports)
    reg = await started(database_url, nats_url)
    # One leaf (the default): the chain planner may start a chain at any source.
    workers = {w: WorkerService(WorkerConfig(worker_id=w, kv_cache_bytes=8 << 20, max_batch_size=4,
                                             max_seq_len=128, torch_threads=1), nats_url)
               for w in (A, B, C, T1, T2)}
    planner: PlannerService | None = None
    try:
        for w in workers.values():
            await w.start()
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, m.DeployModel(
            name=MODEL, path=str(tiny_checkpoint), arch=index.arch, n_layers=index.n_layers,
            blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                                layer_end=b.layer_end) for b in index.blocks],
            min_instances=0, max_instances=5, keep_alive_s=600, scaling_mode="chain"), m.ModelInfo)

        # w-a and w-c serve the model (each read it from disk: a host copy each); w-b keeps an idle copy.
        for w in (A, C):
            load = m.LoadModel(instance_id=f"i-{w}", model=MODEL, path=str(tiny_checkpoint), block_start=0,
                               block_end=n_blocks)
            assert (await call(client, subjects.worker_command(w), load, m.CommandAck)).accepted
        fetch = m.FetchBlocks(model=MODEL, path=str(tiny_checkpoint), blocks=list(range(n_blocks)), keep=True)
        assert (await call(client, subjects.worker_command(B), fetch, m.CommandAck)).accepted
        await until_view(client, lambda v: set(loaded_local(v)) == {A, C} and host_copies(v, n_blocks) == {A, B, C},
                         60, "two serving copies and an idle one")

        if pipeline:
            # An execution pipeline over w-a (stage 0, the entry) and w-c: its activations go out
            # of w-a's link. Later stages first, then the entry (as the planner sends them).
            start = m.StartPipeline(instance_id=PIPELINE, model=MODEL, path=str(tiny_checkpoint),
                                    stages=[m.Stage(worker_id=A, block_start=0, block_end=1),
                                            m.Stage(worker_id=C, block_start=1, block_end=n_blocks)],
                                    peers={w: workers[w].transport.address for w in (A, C)})
            for w in (C, A):
                assert (await call(client, subjects.worker_command(w), start, m.CommandAck)).accepted
            before = await until_view(client, lambda v: any(
                i.instance_id == PIPELINE and i.state == m.InstanceState.ready for i in v.instances),
                30, "the pipeline serving")
            # The planner reads the same view: the pipeline's stages are there, on w-a and w-c.
            (served,) = [i for i in before.instances if i.instance_id == PIPELINE]
            assert served.mode == "pipeline" and [s.worker_id for s in served.stages] == [A, C], served
            # It serves: a request through it runs block 0 on w-a, block 1 on w-c.
            tokens = await generate(client, A, PIPELINE, "through-the-pipeline")
            assert [t.finish_reason for t in tokens if t.finished] == ["length"], tokens
            assert all(t.error is None for t in tokens) and sum(t.token_id is not None for t in tokens) == 4, tokens

        planner = PlannerService(nats_url)
        await planner.start()
        # As the load-monitor would ask: five instances (w-b loads its own copy, w-t1 and w-t2 receive).
        await publish(client, subjects.SCALE_REQUEST, m.ScaleRequest(model=MODEL, desired_instances=5,
                                                                     reason="test burst"))
        # The operation closes on the planner's copy of the instance events; the registry's view
        # may hear them a moment later: wait for both.
        after = await until_view(
            client, lambda v: any(o.direction == "up" and o.state == "done" for o in v.scale_ops)
            and {B, T1, T2} <= set(loaded_local(v)), 60, "the scale-out to close, its targets loaded")
        (op,) = [o for o in after.scale_ops if o.direction == "up"]
        # Every worker with a part (its senders and receivers) reports how it ended.
        parts = {T1, T2, *op.plan.get("sources", [])}
        await until(lambda: {r.worker_id for r in reports if r.scale_op_id == op.scale_op_id} >= parts, 10)
    finally:
        if planner is not None:
            await planner.stop()
        for w in workers.values():
            await w.stop()
        await reg.stop()
        await sub.stop()

    plan = op.plan
    assert plan["kind"] == "multicast" and plan["algorithm"] == "chain", plan
    assert sorted(plan["targets"]) == [B, T1, T2] and sorted(plan["receivers"]) == [T1, T2], plan
    # Every target got the model (loaded, above); each receiver got every byte over the data plane.
    ours = [r for r in reports if r.scale_op_id == op.scale_op_id]
    assert all(r.ok for r in ours), ours
    received = {r.worker_id: r.bytes_received for r in ours if r.bytes_received}
    assert received == {T1: model_bytes, T2: model_bytes}, ours
    sent = {r.worker_id: r.bytes_sent for r in ours if r.bytes_sent}
    if pipeline:
        # w-a and w-c stream activations: w-b, the quiet copy, is the one source; w-a sends nothing.
        assert plan["sources"] == [B], plan
        assert A not in sent and C not in sent and sent.get(B, 0) > 0, sent
        # ... and the pipeline served all along.
        (served,) = [i for i in after.instances if i.instance_id == PIPELINE]
        assert served.state == m.InstanceState.ready, served
    else:
        # Nothing prunes w-a now: the chains start at the serving copies (w-b is a target and
        # sorts last), w-a sends.
        assert A in plan["sources"] and B not in plan["sources"], plan
        assert sent.get(A, 0) > 0 and B not in sent, sent
