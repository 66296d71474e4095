"""PlannerService choosing scale-out targets by the load-time estimate (ServerlessLLM §6.2)
through the in-memory ports (fake_ports.py): the workers it loads follow the estimate, and the
operation's record carries the estimate and, once loaded, the measured time beside it."""

import time

import pytest

from fake_ports import InMemoryRegistry, InMemoryWorkers
from libs.planning import scaleop as so
from libs.planning.load_estimate import DEFAULT_SSD_TO_HOST_GBPS
from libs.protocol import messages as m
from services.planner.service import PlannerService

GB = 10**9
N_BLOCKS = 4
BLOCK = GB // 4


def _worker(wid: str, **bandwidths_gbps: float) -> m.WorkerInfo:
    return m.WorkerInfo(worker_id=wid, data_address=f"{wid}:7000", topology=m.Topology(host=wid, link_gbps=10.0),
                        capacities={m.Tier.host: 64 * GB}, bandwidths_gbps=bandwidths_gbps, state="alive",
                        last_heartbeat=0.0)


def _model(name: str, block: int = BLOCK) -> m.ModelInfo:
    blocks = [m.BlockInfo(block_id=b, nbytes=block, checksum="", layer_start=b, layer_end=b + 1)
              for b in range(N_BLOCKS)]
    return m.ModelInfo(name=name, path=f"/models/{name}", arch="toy", n_layers=N_BLOCKS, blocks=blocks,
                       max_instances=4, scaling_mode="serverlessllm", state=m.ModelState.deployed, created_at=0.0)


def _copy(wid: str, tier: m.Tier, name: str = "m") -> list[m.ReplicaInfo]:
    return [m.ReplicaInfo(model=name, block_id=b, worker_id=wid, tier=tier, state=m.ReplicaState.ready)
            for b in range(N_BLOCKS)]


def _view() -> m.ClusterView:
    """w0 serves m; a-host holds m in host memory but loads a 32 GB model first; b-ssd has m on
    its local disk; c-none has nothing. Ids in the order today's ranking would take them."""
    serving = m.InstanceInfo(instance_id="i0", model="m", state=m.InstanceState.ready, created_at=0.0,
                             loaded_at=0.0, stages=[m.Stage(worker_id="w0", block_start=0, block_end=N_BLOCKS)])
    queued = m.InstanceInfo(instance_id="i-big", model="big", state=m.InstanceState.loading, created_at=0.0,
                            stages=[m.Stage(worker_id="a-host", block_start=0, block_end=N_BLOCKS)])
    return m.ClusterView(workers=[_worker(w) for w in ("w0", "a-host", "b-ssd", "c-none")],
                         models=[_model("m"), _model("big", 8 * GB)],
                         replicas=_copy("w0", m.Tier.host) + _copy("a-host", m.Tier.host) + _copy("b-ssd", m.Tier.ssd),
                         instances=[serving, queued], scale_ops=[])


async def test_the_planner_loads_where_the_estimate_is_least_and_records_it_beside_the_measured_time():
    registry, workers = InMemoryRegistry(_view()), InMemoryWorkers()
    planner = PlannerService(registry=registry, workers=workers, timers=so.Timers())
    op = await planner.reconcile(m.ScaleRequest(model="m", desired_instances=3, reason="test"))
    loads = {s.worker_id: s.cmd for s in workers.of(m.LoadModel)}
    # The local disk beats the host copy queued behind 32 GB, and the network comes next.
    assert set(loads) == {"b-ssd", "c-none"}
    estimate = registry.ops[op.scale_op_id].plan["estimated_load_s"]
    assert estimate["b-ssd"] == pytest.approx(GB / (DEFAULT_SSD_TO_HOST_GBPS * GB))
    assert estimate["c-none"] == pytest.approx(GB / (10.0 / 8 * GB))  # the link, until measured
    assert "measured_load_s" not in registry.ops[op.scale_op_id].plan

    planned = registry.ops[op.scale_op_id].timings["planned"]
    for w, load in loads.items():
        loaded_at = time.time()
        await planner.on_instance(registry.report(m.InstanceInfo(
            instance_id=load.instance_id, model="m", state=m.InstanceState.ready, created_at=0.0,
            ready_at=loaded_at, loaded_at=loaded_at, scale_op_id=load.scale_op_id,
            stages=[m.Stage(worker_id=w, block_start=0, block_end=N_BLOCKS)])))
    record = registry.ops[op.scale_op_id]
    assert record.state == "done"
    assert record.plan["estimated_load_s"] == estimate
    measured = record.plan["measured_load_s"]
    assert set(measured) == {"b-ssd", "c-none"}
    assert all(measured[w] == pytest.approx(record.timings[f"loaded:{loads[w].instance_id}"] - planned, abs=1e-5)
               for w in measured)


async def test_measured_bandwidths_from_the_registry_change_the_choice():
    view = _view()
    # c-none measured a fast network and b-ssd a slow disk: the network now wins.
    view.workers[2] = _worker("b-ssd", ssd_to_host=0.5)
    view.workers[3] = _worker("c-none", network_to_host=12.0)
    registry, workers = InMemoryRegistry(view), InMemoryWorkers()
    planner = PlannerService(registry=registry, workers=workers, timers=so.Timers())
    op = await planner.reconcile(m.ScaleRequest(model="m", desired_instances=2, reason="test"))
    assert [s.worker_id for s in workers.of(m.LoadModel)] == ["c-none"]
    assert list(registry.ops[op.scale_op_id].plan["estimated_load_s"]) == ["c-none"]
