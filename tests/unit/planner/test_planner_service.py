"""PlannerService without NATS: driven through its handlers against the in-memory ports
(fake_ports.py), asserting on what it sent to the workers and what the registry holds."""

import asyncio
import time

import pytest

from fake_ports import InMemoryRegistry, InMemoryWorkers
from libs.planning import scaleop as so
from libs.protocol import messages as m
from services.planner.service import PlannerService

N_BLOCKS = 4


def _worker(wid: str) -> m.WorkerInfo:
    return m.WorkerInfo(worker_id=wid, data_address=f"{wid}:7000", topology=m.Topology(host=wid, link_gbps=10.0),
                        capacities={m.Tier.host: 1 << 30}, state="alive", last_heartbeat=0.0)


def _view(mode: str = "layercast") -> m.ClusterView:
    """w0 runs the only instance and holds the host copy; w1..w3 are free."""
    blocks = [m.BlockInfo(block_id=b, nbytes=1 << 20, checksum="", layer_start=b, layer_end=b + 1)
              for b in range(N_BLOCKS)]
    model = m.ModelInfo(name="m", path="/models/m", arch="toy", n_layers=N_BLOCKS, blocks=blocks, min_instances=0,
                        max_instances=4, scaling_mode=mode, state=m.ModelState.deployed, created_at=0.0)
    copy = [m.ReplicaInfo(model="m", block_id=b, worker_id="w0", tier=m.Tier.host, state=m.ReplicaState.ready)
            for b in range(N_BLOCKS)]
    serving = m.InstanceInfo(instance_id="i0", model="m", state=m.InstanceState.ready, created_at=0.0,
                             loaded_at=0.0, stages=[m.Stage(worker_id="w0", block_start=0, block_end=N_BLOCKS)])
    return m.ClusterView(workers=[_worker(f"w{i}") for i in range(4)], models=[model], replicas=copy,
                         instances=[serving], scale_ops=[])


def _planner(registry, workers, **timers) -> PlannerService:
    return PlannerService(registry=registry, workers=workers, timers=so.Timers(**timers))


def _loaded(registry: InMemoryRegistry, load: m.LoadModel, worker: str) -> m.InstanceEvent:
    """The worker reports its instance loaded; the registry hears it (the planner, if passed on)."""
    return registry.report(m.InstanceInfo(
        instance_id=load.instance_id, model="m", state=m.InstanceState.ready, created_at=0.0, ready_at=time.time(),
        loaded_at=time.time(), scale_op_id=load.scale_op_id,
        stages=[m.Stage(worker_id=worker, block_start=0, block_end=N_BLOCKS)]))


async def _scale_out(planner, desired: int = 3) -> m.ScaleOpInfo:
    op = await planner.reconcile(m.ScaleRequest(model="m", desired_instances=desired, reason="test"))
    assert op is not None
    return op


def _loads(workers: InMemoryWorkers) -> dict[str, m.LoadModel]:
    return {s.worker_id: s.cmd for s in workers.of(m.LoadModel)}


async def test_a_scale_out_sends_parts_then_loads_and_closes_when_every_target_is_loaded():
    registry, workers = InMemoryRegistry(_view()), InMemoryWorkers()
    planner = _planner(registry, workers)
    op = await _scale_out(planner)
    parts = workers.of(m.TransferPart)
    assert {p.worker_id for p in parts} == {"w0", "w1", "w2"} and all(p.part_id for p in parts)
    assert workers.sent.index(parts[-1]) < workers.sent.index(workers.of(m.LoadModel)[0])  # bytes first
    loads = _loads(workers)
    assert set(loads) == {"w1", "w2"} and all(x.incoming_transfer for x in loads.values())
    assert registry.ops[op.scale_op_id].state == "running"
    for w, load in loads.items():
        await planner.on_instance(_loaded(registry, load, w))
    record = registry.ops[op.scale_op_id]
    assert record.state == "done" and "done" in record.timings and planner.ops == {}


async def test_the_closing_record_goes_after_the_first_however_slow_that_one_is():
    registry, workers = InMemoryRegistry(_view("serverlessllm"), record_delays=[0.05]), InMemoryWorkers()
    planner = _planner(registry, workers)
    task = asyncio.create_task(_scale_out(planner, desired=2))
    while not workers.of(m.LoadModel):
        await asyncio.sleep(0)
    (load,) = _loads(workers).values()
    await planner.on_instance(_loaded(registry, load, "w1"))  # closes while the first record is on its way
    op = await task
    await asyncio.sleep(0.1)
    assert registry.ops[op.scale_op_id].state == "done"


async def test_an_ack_lost_fails_its_target_and_the_operation_still_closes():
    registry, workers = InMemoryRegistry(_view("serverlessllm")), InMemoryWorkers()
    planner = _planner(registry, workers)
    workers.silent = {"w2"}  # w2's answer to its LoadModel never comes
    op = await _scale_out(planner)
    loads = _loads(workers)
    (failed,) = [e.instance for e in registry.heard if e.instance.state == m.InstanceState.failed]
    assert failed.instance_id == loads["w2"].instance_id and registry.instances[failed.instance_id] == failed
    assert planner.ops[op.scale_op_id].waiting() == [loads["w1"].instance_id]
    await planner.on_instance(_loaded(registry, loads["w1"], "w1"))
    assert registry.ops[op.scale_op_id].state == "done" and planner.ops == {}


async def test_an_instance_event_lost_on_its_way_is_read_back_from_the_registry_by_the_periodic_check():
    registry, workers = InMemoryRegistry(_view("serverlessllm")), InMemoryWorkers()
    planner = _planner(registry, workers, check_instances_s=0.0)
    op = await _scale_out(planner, desired=2)
    (load,) = _loads(workers).values()
    _loaded(registry, load, "w1")  # the registry heard it; the planner did not
    planner.views.mark_stale()
    assert planner.ops[op.scale_op_id].waiting() == [load.instance_id]
    await planner.tick()
    record = registry.ops[op.scale_op_id]
    assert record.state == "done" and f"loaded:{load.instance_id}" in record.timings and planner.ops == {}


async def test_a_planner_restarted_mid_operation_follows_only_the_targets_still_on_their_way():
    registry, workers = InMemoryRegistry(_view("serverlessllm")), InMemoryWorkers()
    first = _planner(registry, workers)
    op = await _scale_out(first)
    loads = _loads(workers)
    await first.on_instance(_loaded(registry, loads["w1"], "w1"))
    assert registry.ops[op.scale_op_id].state == "running"
    # The first planner dies here; a second takes over from the registry.
    workers.sent.clear()
    second = _planner(registry, workers)
    assert await second.resume_open_ops() == {op.scale_op_id: "resumed"}
    assert [(s.worker_id, s.part_id) for s in workers.sent] == [("w2", f"{loads['w2'].instance_id}:resume")]
    assert second.ops[op.scale_op_id].waiting() == [loads["w2"].instance_id]
    await second.on_instance(_loaded(registry, loads["w2"], "w2"))
    record = registry.ops[op.scale_op_id]
    assert record.state == "done" and {f"loaded:{x.instance_id}" for x in loads.values()} <= set(record.timings)
    assert await _planner(registry, workers).resume_open_ops() == {}


async def test_a_receiver_that_dies_mid_multicast_fails_its_pipeline_and_the_operation_ends_partial():
    registry, workers = InMemoryRegistry(_view("layercast")), InMemoryWorkers()
    planner = _planner(registry, workers)
    op = await _scale_out(planner, desired=4)  # 1 -> 3: a binomial's receivers form a pipeline (1 -> 2 is a chain)
    assert op.plan["pipelines"] == [["w1", "w2", "w3"]]
    for w, blocks in (("w1", (0, 1)), ("w2", (2, 3))):
        for b in blocks:
            await planner.on_block(m.BlockEvent(model="m", block_id=b, worker_id=w, tier=m.Tier.gpu,
                                                state=m.ReplicaState.ready, scale_op_id=op.scale_op_id))
    (start_later, start_entry) = workers.of(m.StartPipeline)
    assert (start_later.worker_id, start_entry.worker_id) == ("w2", "w1")  # later stages first
    pid = start_entry.cmd.instance_id
    assert f"pipeline_ready:{pid}" in planner.ops[op.scale_op_id].timings
    workers.sent.clear()

    await planner.on_worker_expired(m.WorkerExpired(worker_id="w2", last_heartbeat=0.0))
    ended = [e.instance for e in registry.heard if e.instance.instance_id == pid]
    assert ended[-1].state == m.InstanceState.failed
    assert [(s.worker_id, s.cmd.instance_id) for s in workers.of(m.UnloadModel)] == [("w1", pid), ("w2", pid)]
    # The registry fails the dead worker's instance; w1 and w3 load; the operation ends with two of three.
    loads = _loads_of(registry, op.scale_op_id)
    dead = registry.report(registry.instances[loads["w2"]].model_copy(update={"state": m.InstanceState.failed}))
    await planner.on_instance(dead)
    for w in ("w1", "w3"):
        await planner.on_instance(_loaded(registry, _load_of(registry, loads[w]), w))
    record = registry.ops[op.scale_op_id]
    assert record.state == "done" and f"failed:{loads['w2']}" in record.timings and planner.ops == {}


def _loads_of(registry: InMemoryRegistry, op_id: str) -> dict[str, str]:
    return {i.stages[0].worker_id: i.instance_id for i in registry.instances.values()
            if i.scale_op_id == op_id and i.mode == "local"}


def _load_of(registry: InMemoryRegistry, iid: str) -> m.LoadModel:
    inst = registry.instances[iid]
    return m.LoadModel(instance_id=iid, model="m", path="/models/m", block_start=0, block_end=N_BLOCKS,
                       scale_op_id=inst.scale_op_id)


async def test_a_refused_part_cancels_the_multicast_and_records_a_local_load():
    registry, workers = InMemoryRegistry(_view("layercast")), InMemoryWorkers(refuse={"w2": "busy"})
    planner = _planner(registry, workers)
    op = await _scale_out(planner)
    assert op.plan["kind"] == "local-load" and "first_send" not in op.timings
    # w2 refused its part (and then its load): the others cancel theirs, in the background.
    await _settle()
    assert {s.worker_id for s in workers.of(m.CancelTransfer)} == {"w0", "w1"}
    assert all(x.incoming_transfer is None for x in _loads(workers).values())


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_the_pool_check_fills_a_lost_copy_once_within_its_grace():
    view = _view("layercast").model_copy(update={"replicas": [], "instances": []})
    registry, workers = InMemoryRegistry(view), InMemoryWorkers()
    planner = _planner(registry, workers, pool_fill_grace_s=120.0)
    await planner.check_pool()
    (fetch,) = workers.of(m.FetchBlocks)
    assert fetch.cmd.blocks == list(range(N_BLOCKS)) and fetch.cmd.keep
    await planner.check_pool()
    assert len(workers.of(m.FetchBlocks)) == 1  # its blocks are still on their way
    await planner.on_model(m.ModelEvent(kind="deleted", model=view.models[0]))
    assert {s.worker_id for s in workers.of(m.ReleaseBlocks)} == {"w0", "w1", "w2", "w3"}


@pytest.fixture(autouse=True)
def _no_nats(monkeypatch):
    """Nothing here may reach NATS: the broker is never started."""
    from faststream.nats import NatsBroker

    async def refuse(*args, **kwargs):
        raise AssertionError("the planner tried to use NATS")
    monkeypatch.setattr(NatsBroker, "publish", refuse)
    monkeypatch.setattr(NatsBroker, "request", refuse)


async def test_a_lost_pool_copy_is_re_replicated_onto_a_survivor_when_its_holder_expires():
    """The unit-level oracle of tests/integration/test_parameter_pool.py: what the planner commands."""
    view = _view("layercast").model_copy(update={"instances": []})  # w0 holds the only copy, nothing serves
    registry, workers = InMemoryRegistry(view), InMemoryWorkers()
    planner = _planner(registry, workers)
    await planner.check_pool()
    assert workers.sent == []  # the copy is complete
    # w0 dies; w2 still holds block 1 in its host tier.
    survivors = [w if w.worker_id != "w0" else w.model_copy(update={"state": "dead"}) for w in view.workers]
    held = m.ReplicaInfo(model="m", block_id=1, worker_id="w2", tier=m.Tier.host, state=m.ReplicaState.ready)
    registry.view = view.model_copy(update={"workers": survivors, "replicas": [held]})
    await planner.on_worker_expired(m.WorkerExpired(worker_id="w0", last_heartbeat=0.0))
    (fetch,) = workers.of(m.FetchBlocks)
    assert fetch.worker_id == "w2" and fetch.cmd.blocks == list(range(N_BLOCKS)) and fetch.cmd.keep
    assert workers.of(m.TransferPart) == []  # the one held block is w2's own: nothing to gather
    await planner.on_worker_expired(m.WorkerExpired(worker_id="w0", last_heartbeat=0.0))
    assert len(workers.of(m.FetchBlocks)) == 1  # within its grace: not sent again


def _chain_view(pipeline_on_w0: bool) -> m.ClusterView:
    """Mode chain; w0..w5 on two leaves round-robin; w0 and w1 hold the host copy and serve;
    optionally w0 also runs a stage of another model's execution pipeline (w0 -> w4)."""
    base = _view("chain")
    workers = [m.WorkerInfo(worker_id=f"w{i}", data_address=f"w{i}:7000",
                            topology=m.Topology(host=f"w{i}", leaf=f"leaf-{i % 2}", link_gbps=10.0),
                            capacities={m.Tier.host: 1 << 30}, state="alive", last_heartbeat=0.0) for i in range(6)]
    model = base.models[0].model_copy(update={"max_instances": 6})
    copy1 = [r.model_copy(update={"worker_id": "w1"}) for r in base.replicas]
    serving1 = base.instances[0].model_copy(update={"instance_id": "i1", "stages": [
        m.Stage(worker_id="w1", block_start=0, block_end=N_BLOCKS)]})
    instances = [*base.instances, serving1]
    if pipeline_on_w0:
        instances.append(m.InstanceInfo(instance_id="p", model="other", mode="pipeline", state=m.InstanceState.ready,
                                        created_at=0.0, stages=[m.Stage(worker_id="w0", block_start=0, block_end=2),
                                                                m.Stage(worker_id="w4", block_start=2, block_end=4)]))
    return base.model_copy(update={"workers": workers, "models": [model], "replicas": base.replicas + copy1,
                                   "instances": instances})


@pytest.mark.parametrize("pipeline_on_w0", [False, True])
async def test_a_chain_scale_out_sends_from_no_source_that_serves_a_pipeline_while_another_source_exists(
        pipeline_on_w0):
    registry, workers = InMemoryRegistry(_chain_view(pipeline_on_w0)), InMemoryWorkers()
    op = await _scale_out(_planner(registry, workers), desired=5)
    parts = {p.worker_id: p.cmd for p in workers.of(m.TransferPart)}
    senders = {w for w, part in parts.items() if part.sends}
    plan = registry.ops[op.scale_op_id].plan
    assert plan["algorithm"] == "chain"
    if pipeline_on_w0:
        # w0 streams activations to w4: only w1 sends; w0 gets no part at all.
        assert plan["sources"] == ["w1"] and "w0" not in parts and "w1" in senders
    else:
        # Both copies send, each down its own leaf: no hop crosses the spine.
        assert sorted(plan["sources"]) == ["w0", "w1"] and {"w0", "w1"} <= senders
        leaf = {f"w{i}": i % 2 for i in range(6)}
        assert all(leaf[w] == leaf[h.peer] for w, part in parts.items() for h in part.sends)
