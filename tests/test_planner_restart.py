"""A planner that starts finds the scale operations a previous planner left open and ends them
as aborted (nobody follows them any more), against real NATS and Postgres."""

from libs.protocol import messages as m
from libs.protocol import subjects
from libs.protocol.bus import call
from services.planner.service import PlannerService
from test_registry import client, deployment, started  # noqa: F401 - the client fixture


async def test_a_restarted_planner_aborts_the_operations_left_open(database_url, nats_url, client):  # noqa: F811
    reg = await started(database_url, nats_url)
    try:
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        for op_id, state in (("op-open", "running"), ("op-done", "done")):
            await call(client, subjects.REGISTRY_SCALEOP_RECORD, m.RecordScaleOp(
                scale_op_id=op_id, model="demo", direction="up", reason="test", from_instances=0, to_instances=1,
                state=state, timings={"decided": 1.0}), m.ScaleOpInfo)
        planner = PlannerService(nats_url)
        await planner.start()
        try:
            view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
            ops = {o.scale_op_id: o for o in view.scale_ops}
            assert ops["op-open"].state == "aborted" and ops["op-open"].error == "the planner restarted"
            assert ops["op-open"].timings["decided"] == 1.0 and "done" in ops["op-open"].timings
            assert ops["op-done"].state == "done"
            assert await planner.abort_orphaned_ops() == []  # nothing left to abort
        finally:
            await planner.stop()
    finally:
        await reg.stop()
