"""A planner that starts takes over the scale operations a previous planner left open: a
scale-out with instances still on their way is resumed and followed to its end, one with
nothing left to follow ends as aborted (against real NATS, Postgres and a real worker)."""

import asyncio

from libs.checkpoint import CheckpointIndex
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import call
from services.planner.service import PlannerService
from services.worker.service import WorkerConfig, WorkerService
from test_registry import client, deployment, started  # noqa: F401 - the client fixture


async def scale_ops(client) -> dict[str, m.ScaleOpInfo]:  # noqa: F811
    view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
    return {o.scale_op_id: o for o in view.scale_ops}


async def record(client, op_id: str, state: str, model: str = "demo") -> None:  # noqa: F811
    await call(client, subjects.REGISTRY_SCALEOP_RECORD, m.RecordScaleOp(
        scale_op_id=op_id, model=model, direction="up", reason="test", from_instances=0, to_instances=1,
        state=state, timings={"decided": 1.0}), m.ScaleOpInfo)


async def test_a_restarted_planner_aborts_the_operations_with_nothing_to_follow(database_url, nats_url, client):  # noqa: F811
    reg = await started(database_url, nats_url)
    try:
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        await record(client, "op-open", "running")
        await record(client, "op-done", "done")
        planner = PlannerService(nats_url)
        await planner.start()
        try:
            ops = await scale_ops(client)
            assert ops["op-open"].state == "aborted" and ops["op-open"].error == "the planner restarted"
            assert ops["op-open"].timings["decided"] == 1.0 and "done" in ops["op-open"].timings
            assert ops["op-done"].state == "done"
            assert await planner.resume_open_ops() == {}  # nothing left open
        finally:
            await planner.stop()
    finally:
        await reg.stop()


async def test_a_restarted_planner_resumes_a_scale_out_whose_instance_was_never_commanded(
        database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    """The previous planner created the instance and died before its LoadModel went out: the new
    planner sends it (through the plan stream), the worker loads, the operation ends done."""
    index = CheckpointIndex.load(tiny_checkpoint)
    reg = await started(database_url, nats_url)
    worker = WorkerService(WorkerConfig(worker_id="w-resume", kv_cache_bytes=8 << 20), nats_url)
    await worker.start()
    try:
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, m.DeployModel(
            name="resumed", path=str(tiny_checkpoint), arch=index.arch, n_layers=index.n_layers,
            blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                                layer_end=b.layer_end) for b in index.blocks],
            min_instances=0, max_instances=1), m.ModelInfo)
        await record(client, "op-resume", "running", model="resumed")
        await call(client, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
            instance_id="i-resume", model="resumed", scale_op_id="op-resume",
            stages=[m.Stage(worker_id="w-resume", block_start=0, block_end=index.n_blocks)]), m.InstanceInfo)
        planner = PlannerService(nats_url)
        await planner.start()
        try:
            for _ in range(100):
                op = (await scale_ops(client))["op-resume"]
                if op.state != "running":
                    break
                await asyncio.sleep(0.1)
            assert op.state == "done", op
            assert "loaded:i-resume" in op.timings and "i-resume" in worker.instances
            view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
            (inst,) = [i for i in view.instances if i.instance_id == "i-resume"]
            assert inst.state == m.InstanceState.ready and inst.loaded_at is not None
        finally:
            await planner.stop()
    finally:
        await worker.stop()
        await reg.stop()
