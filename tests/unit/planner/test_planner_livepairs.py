"""The planner forms live pairs (BlitzScale §5.2) in `blitzscale` scale-outs, through the in-memory
ports: FormLivePair to the chain target, then to the serving source, once the target's load is
accepted; a pair's end frees both instances; other modes never pair."""

from fake_ports import InMemoryRegistry, InMemoryWorkers
from libs.planning import scaleop as so
from libs.protocol import messages as m
from services.planner.service import PlannerService
from test_planner_service import N_BLOCKS, _loaded, _loads, _view


def _blitz_view(mode: str = "blitzscale") -> m.ClusterView:
    """w0 serves i0 (every block) and holds the host copy; a TTFT SLO shorter than any load."""
    view = _view(mode)
    model = view.models[0].model_copy(update={"ttft_slo_s": 1e-4})
    return view.model_copy(update={"models": [model]})


async def _scale_out(mode: str = "blitzscale", workers: InMemoryWorkers | None = None):
    registry, workers = InMemoryRegistry(_blitz_view(mode)), workers or InMemoryWorkers()
    planner = PlannerService(registry=registry, workers=workers, timers=so.Timers())
    op = await planner.reconcile(m.ScaleRequest(model="m", desired_instances=2, reason="load past the bound"))
    assert op is not None
    return planner, registry, workers, op


def _instance(iid: str, worker: str, state: m.InstanceState) -> m.InstanceInfo:
    return m.InstanceInfo(instance_id=iid, model="m", state=state, created_at=0.0,
                          stages=[m.Stage(worker_id=worker, block_start=0, block_end=N_BLOCKS)])


async def test_a_blitzscale_scale_out_pairs_the_serving_instance_with_its_chain_target_target_first():
    planner, registry, workers, op = await _scale_out()
    (target, load), = _loads(workers).items()
    assert load.incoming_transfer and not load.serve_while_loading  # a chain target, stop-the-world
    forms = workers.of(m.FormLivePair)
    assert [s.worker_id for s in forms] == [target, "w0"]  # the target's front first, then the source
    form = forms[0].cmd
    assert (form.source_instance, form.source_worker, form.target_instance) == ("i0", "w0", load.instance_id)
    assert set(form.peers) == {"w0", target} and form.scale_op_id == op.scale_op_id
    # Only after the target's load was accepted (its lifecycle is loading then).
    assert workers.sent.index(workers.of(m.LoadModel)[0]) < workers.sent.index(forms[0])
    # The planner's view holds the pair: both workers' links serve.
    (pair,) = so.open_live_pairs(planner.ops.values())
    assert (pair.source_worker, pair.target_worker) == ("w0", target)
    assert "live_pairs" in registry.ops[op.scale_op_id].plan

    # The target's last block: the pair dissolved by itself, both are free, the operation done.
    await planner.on_instance(_loaded(registry, load, target))
    assert so.open_live_pairs(planner.ops.values()) == []
    record = registry.ops[op.scale_op_id]
    assert record.state == "done"
    assert record.timings[f"paired:{load.instance_id}"] <= record.timings[f"unpaired:{load.instance_id}"]


async def test_each_blitzscale_mode_tells_both_workers_its_split_policy():
    for mode, split in (("blitzscale", "zigzag"), ("blitzscale-fixed", "fixed")):
        _, _, workers, _ = await _scale_out(mode)
        forms = workers.of(m.FormLivePair)
        assert len(forms) == 2 and {f.cmd.split for f in forms} == {split}, mode


async def test_the_pairs_source_stopping_or_a_workers_loss_frees_the_pair_and_the_scale_out_goes_on():
    planner, registry, workers, op = await _scale_out()
    (target, load), = _loads(workers).items()
    await planner.on_instance(m.InstanceEvent(instance=_instance("i0", "w0", m.InstanceState.draining)))
    assert so.open_live_pairs(planner.ops.values()) == []
    assert planner.ops[op.scale_op_id].targets[load.instance_id].waiting  # the target still loads
    await planner.on_instance(_loaded(registry, load, target))
    assert registry.ops[op.scale_op_id].state == "done"

    planner, registry, workers, op = await _scale_out()
    (target, load), = _loads(workers).items()
    await planner.on_worker_expired(m.WorkerExpired(worker_id="w0", last_heartbeat=0.0))
    assert so.open_live_pairs(planner.ops.values()) == []
    assert planner.ops[op.scale_op_id].targets[load.instance_id].waiting


async def test_a_source_refusing_its_pair_ends_the_targets_part_and_frees_both():
    planner, registry, workers, op = await _scale_out(workers=InMemoryWorkers(refuse={"w0": "cannot pair"}))
    (target, load), = _loads(workers).items()
    ends = workers.of(m.EndLivePair)
    assert [(s.worker_id, s.cmd.instance_id) for s in ends] == [(target, load.instance_id)]
    assert so.open_live_pairs(planner.ops.values()) == []
    assert f"paired:{load.instance_id}" not in planner.ops[op.scale_op_id].timings


async def test_modes_without_live_pairs_never_pair():
    for mode in ("chain", "blitzscale-nopairs"):
        planner, registry, workers, op = await _scale_out(mode)
        assert _loads(workers) and not workers.of(m.FormLivePair), mode
        assert so.open_live_pairs(planner.ops.values()) == []


async def test_while_a_pair_is_open_its_source_is_not_a_chain_source_another_one_is():
    """w3 holds a second host copy: with i0's pair open, the next scale-out sends from w3 only."""
    planner, registry, workers, op = await _scale_out()
    (target, load), = _loads(workers).items()
    extra = "w3" if target != "w3" else "w2"
    registry.view = registry.view.model_copy(update={"replicas": registry.view.replicas + [
        m.ReplicaInfo(model="m", block_id=b, worker_id=extra, tier=m.Tier.host, state=m.ReplicaState.ready)
        for b in range(N_BLOCKS)]})
    planner.views.mark_stale()
    before = len(workers.of(m.TransferPart))
    await planner.reconcile(m.ScaleRequest(model="m", desired_instances=4, reason="more load"))
    senders = {s.worker_id for s in workers.of(m.TransferPart)[before:] if s.cmd.sends}
    assert senders and "w0" not in senders


async def test_a_source_that_is_still_a_target_of_an_open_operation_ends_the_pair_of_the_operation_that_paired_it():
    """Op A (1 -> 3) pairs i0 with one target; its other target loads and serves while A waits for
    the paired one. Op B (3 -> 4) pairs that loaded target with its own target. The loaded
    target's events go to A (it is A's target) and to B (it is B's pair source)."""
    view = _blitz_view()
    view = view.model_copy(update={
        "workers": view.workers + [view.workers[0].model_copy(update={"worker_id": "w4", "data_address": "w4:7000"})],
        "models": [view.models[0].model_copy(update={"max_instances": 5})]})
    registry, workers = InMemoryRegistry(view), InMemoryWorkers()
    planner = PlannerService(registry=registry, workers=workers, timers=so.Timers())
    op_a = await planner.reconcile(m.ScaleRequest(model="m", desired_instances=3, reason="load"))
    (pair_a,) = so.open_live_pairs(planner.ops.values())
    loads = _loads(workers)
    (free_worker,) = [w for w in loads if w != pair_a.target_worker]
    await planner.on_instance(_loaded(registry, loads[free_worker], free_worker))
    assert planner.ops[op_a.scale_op_id].state == "running"  # its paired target still loads

    op_b = await planner.reconcile(m.ScaleRequest(model="m", desired_instances=4, reason="more load"))
    pair_b = next(p for p in so.open_live_pairs(planner.ops.values()) if p.scale_op_id == op_b.scale_op_id)
    assert pair_b.source_instance == loads[free_worker].instance_id  # i0 is paired already

    draining = _instance(pair_b.source_instance, free_worker, m.InstanceState.draining)
    await planner.on_instance(m.InstanceEvent(instance=draining.model_copy(update={"scale_op_id": op_a.scale_op_id})))
    assert [p.scale_op_id for p in so.open_live_pairs(planner.ops.values())] == [op_a.scale_op_id]
