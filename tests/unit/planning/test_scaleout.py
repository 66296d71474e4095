"""Scale decisions per scaling mode (libs.planning.scaleout) and multicast sources (placement)."""

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.multicast import kway_chain_schedule, validate_schedule
from libs.planning.multicast_choice import CHOICE_ORDER
from libs.planning.placement import Held, full_copies
from libs.planning.scaleout import (
    MODES,
    MULTICAST_ALGORITHMS,
    SERVERLESSLLM_KEEP_ALIVE_S,
    MulticastAlgorithm,
    ScaleIn,
    ScalePlan,
    build_plan,
    decide,
    held_blocks,
    live_pair_workers,
    mode_spec,
    plan_bound_s,
    plan_nodes,
    plan_scale_in,
    plan_scale_out,
    predicted,
    scaleout_plan,
    target_load,
)

MULTICAST_MODES = [name for name, spec in MODES.items() if spec.multicast]
from libs.protocol import messages as m


@settings(max_examples=150, deadline=None)
@given(mode=st.sampled_from(MULTICAST_MODES), sources=st.integers(1, 4), targets=st.integers(1, 9),
       blocks=st.integers(1, 12), link_gbps=st.sampled_from([0.4, 10.0, 100.0]))
def test_every_multicast_mode_plans_a_valid_schedule_that_reaches_every_target(mode, sources, targets, blocks,
                                                                                link_gbps):
    plan = scaleout_plan(mode, sources, targets, 64 << 20, blocks, link_gbps)
    assert 1 <= plan.k <= min(sources, targets)
    names = plan_nodes(plan, [f"s{i}" for i in range(sources)], [f"t{i}" for i in range(targets)])
    assert len(names) == plan.k + targets and len(set(names)) == len(names)
    # Sources hold every block at the start; every target ends with every block, one port per node.
    validate_schedule(plan.schedule, len(names), blocks, sources=range(plan.k))
    expected = {"chain": "chain", "binomial": "binomial", "faasnet": "binary-tree"}.get(mode)
    assert expected is None or plan.algorithm == expected


@pytest.mark.parametrize("mode", ["serverlessllm", "static", "ideal"])
def test_modes_that_do_not_multicast_plan_nothing(mode):
    assert scaleout_plan(mode, 2, 3, 1 << 20, 4, 10.0) is None


def test_no_source_or_no_target_means_no_multicast():
    assert scaleout_plan("layercast", 0, 3, 1 << 20, 4, 10.0) is None
    assert scaleout_plan("layercast", 2, 0, 1 << 20, 4, 10.0) is None


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown scaling mode"):
        scaleout_plan("teleport", 1, 1, 1 << 20, 4, 10.0)


def test_full_copies_are_workers_with_every_block_in_host_memory():
    held = [Held("a", 0, "host"), Held("a", 1, "host"), Held("b", 0, "host"), Held("b", 1, "gpu"),
            Held("c", 0, "host"), Held("c", 1, "host"), Held("c", 2, "ssd")]
    assert full_copies([0, 1], held, ["c", "b", "a", "d"]) == ["c", "a"]  # in the given order
    assert full_copies([0, 1, 2], held, ["a", "b", "c"]) == []


# --- the MODES table and the algorithm registry ---------------------------------------------------


def test_modes_are_the_protocols_scaling_modes_in_its_order():
    assert typing.get_args(m.ScalingMode) == tuple(MODES)


def test_an_unknown_mode_has_no_spec():
    with pytest.raises(ValueError, match="unknown scaling mode"):
        mode_spec("teleport")


@pytest.mark.parametrize("name", list(MULTICAST_ALGORITHMS))
def test_every_registered_algorithm_plans_under_its_name_and_has_a_bound(name):
    plan = build_plan(name, 7, 5, 2)
    assert plan.algorithm == name
    assert plan.k == (2 if MULTICAST_ALGORITHMS[name].multi_source else 1)
    validate_schedule(plan.schedule, 7, 5, sources=range(plan.k))
    assert plan_bound_s(plan, 5, 5 << 20, 1e8, 1 << 20) >= (5 << 20) / 1e8  # never below M/R


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown algorithm"):
        build_plan("smoke-signals", 4, 2, 1)


def test_the_choice_order_and_the_registry_are_different_lists():
    # choose_multicast's candidates (k-way is binomial with k sources here) map onto the registry.
    assert set(CHOICE_ORDER) - {"kway"} <= set(MULTICAST_ALGORITHMS)


# --- decisions on hand-built views ----------------------------------------------------------------

N_BLOCKS = 4


def _worker(wid: str, link_gbps: float = 10.0, host_bytes: int = 1 << 30, alive: bool = True) -> m.WorkerInfo:
    return m.WorkerInfo(worker_id=wid, data_address=f"{wid}:7000", topology=m.Topology(host=wid, link_gbps=link_gbps),
                        capacities={m.Tier.host: host_bytes}, state="alive" if alive else "dead", last_heartbeat=0.0)


def _model(mode: str = "layercast", n_blocks: int = N_BLOCKS, min_instances: int = 0, max_instances: int = 4,
           name: str = "m") -> m.ModelInfo:
    blocks = [m.BlockInfo(block_id=b, nbytes=1 << 20, checksum="", layer_start=b, layer_end=b + 1)
              for b in range(n_blocks)]
    return m.ModelInfo(name=name, path=f"/models/{name}", arch="toy", n_layers=n_blocks, blocks=blocks,
                       min_instances=min_instances, max_instances=max_instances, scaling_mode=mode,
                       state=m.ModelState.deployed, created_at=0.0)


def _copy(wid: str, n_blocks: int = N_BLOCKS, tier: m.Tier = m.Tier.host, model: str = "m") -> list[m.ReplicaInfo]:
    return [m.ReplicaInfo(model=model, block_id=b, worker_id=wid, tier=tier, state=m.ReplicaState.ready)
            for b in range(n_blocks)]


def _instance(iid: str, wid: str, state: m.InstanceState = m.InstanceState.ready, model: str = "m") -> m.InstanceInfo:
    return m.InstanceInfo(instance_id=iid, model=model, stages=[m.Stage(worker_id=wid, block_start=0, block_end=4)],
                          state=state, created_at=0.0)


def _view(workers, models, replicas=(), instances=()) -> m.ClusterView:
    return m.ClusterView(workers=list(workers), models=list(models), replicas=list(replicas),
                         instances=list(instances), scale_ops=[])


def _request(n: int, model: str = "m") -> m.ScaleRequest:
    return m.ScaleRequest(model=model, desired_instances=n, reason="test")


def _one_copy_view(mode: str, **model_args) -> m.ClusterView:
    """w0 runs the only instance and holds the host copy; w1..w3 are free."""
    return _view([_worker(f"w{i}") for i in range(4)], [_model(mode, **model_args)], _copy("w0"),
                 [_instance("i0", "w0")])


@pytest.mark.parametrize("mode,algorithm", [("layercast", None), ("chain", "chain"), ("binomial", "binomial"),
                                            ("faasnet", "binary-tree")])
def test_a_multicast_mode_sends_from_the_host_copy_to_every_new_target(mode, algorithm):
    plan = plan_scale_out(_one_copy_view(mode), _request(3))
    assert plan.targets == ("w1", "w2") and plan.from_instances == 1 and plan.to_instances == plan.desired == 3
    assert plan.sources == ("w0",) and plan.receivers == ("w1", "w2") and plan.link_gbps == 10.0
    assert algorithm is None or plan.multicast.algorithm == algorithm
    # binomial serves only on complete copies; layercast's receivers in a pipeline serve there meanwhile.
    early = mode != "binomial" and not plan.pipelines
    assert all(t.receives and not t.preheld and t.serve_while_loading == early for t in plan.loads)
    assert all((t.block_start, t.block_end) == (0, N_BLOCKS) for t in plan.loads)
    assert plan.nodes() == ["w0", "w1", "w2"]
    record = plan.record()
    assert {k: v for k, v in record.items() if k not in ("pipelines", "predicted", "estimated_load_s")} == {
        "kind": "multicast", "mode": mode, "targets": ["w1", "w2"], "blocks": [0, N_BLOCKS],
        "algorithm": plan.multicast.algorithm, "k": 1, "sources": ["w0"], "receivers": ["w1", "w2"]}
    # From one copy to two receivers every schedule is a chain's (the binomial's too): neither
    # receiver ever lacks what the other holds, so no pipeline forms and layercast's targets
    # serve while they load (1 -> 3 forms one: the next test).
    assert plan.pipelines == ()
    assert ("predicted" in record) == (plan.multicast.algorithm in ("binomial", "chain"))


def test_execution_pipelines_follow_the_schedule_not_the_algorithms_name(monkeypatch):
    # Alg. 2 over one sub-group: the three receivers of a binomial multicast form one pipeline.
    plan = plan_scale_out(_one_copy_view("layercast"), _request(4))
    assert plan.multicast.algorithm == "binomial" and plan.pipelines == (("w1", "w2", "w3"),)
    assert not any(t.serve_while_loading for t in plan.loads)
    # The same name over a chain's schedule: its receivers never jointly hold the model before
    # one holds it alone, so no pipeline, and every target serves while it loads.
    chained = MulticastAlgorithm("binomial", kway_chain_schedule, multi_source=True,
                                 candidates=MULTICAST_ALGORITHMS["binomial"].candidates)
    monkeypatch.setitem(MULTICAST_ALGORITHMS, "binomial", chained)
    plan = plan_scale_out(_one_copy_view("layercast"), _request(4))
    assert plan.multicast.algorithm == "binomial" and plan.pipelines == ()
    assert all(t.serve_while_loading for t in plan.loads)


def test_serverlessllm_loads_every_target_on_its_own_and_stops_the_world():
    plan = plan_scale_out(_one_copy_view("serverlessllm"), _request(2))
    assert plan.multicast is None and plan.targets == ("w1",)
    assert [(t.receives, t.preheld, t.serve_while_loading) for t in plan.loads] == [(False, False, False)]
    assert {k: v for k, v in plan.record().items() if k != "estimated_load_s"} == {
        "kind": "local-load", "mode": "serverlessllm", "targets": ["w1"], "blocks": [0, N_BLOCKS]}


def test_ideal_loads_preheld_blocks_without_a_multicast():
    plan = plan_scale_out(_one_copy_view("ideal"), _request(2))
    assert plan.multicast is None and plan.record()["kind"] == "local-load"
    assert [(t.receives, t.preheld, t.serve_while_loading) for t in plan.loads] == [(False, True, True)]


def test_a_static_fleet_stays_at_min_instances_whatever_is_asked():
    view = _one_copy_view("static", min_instances=1)
    assert plan_scale_out(view, _request(3)) is None and decide(view, _request(3)) is None
    assert decide(view, _request(0)) is None
    grow = decide(_one_copy_view("static", min_instances=2), _request(0))
    assert isinstance(grow, ScalePlan) and grow.desired == 2 and grow.targets == ("w1",)


def test_requests_are_clamped_to_min_and_max():
    view = _one_copy_view("layercast", min_instances=1, max_instances=2)
    assert plan_scale_out(view, _request(9)).targets == ("w1",)
    assert decide(view, _request(0)) is None  # min_instances keeps the one


def test_a_target_holding_a_copy_loads_it_itself_and_sends_and_the_least_loaded_source_goes_first():
    workers = [_worker("w0", link_gbps=25.0), _worker("w1", link_gbps=25.0), _worker("w2", link_gbps=5.0),
               _worker("w3", link_gbps=100.0), _worker("w4")]
    replicas = _copy("w0") + _copy("w1") + _copy("w2")
    view = _view(workers, [_model("chain")], replicas, [_instance("i0", "w0"), _instance("i1", "w1")])
    plan = plan_scale_out(view, _request(4), load={"w0": 5, "w1": 1})
    assert plan.targets == ("w2", "w3")  # w2 holds the copy: nearest first
    # w2 loads its own copy and its link is idle: it sends as well (least loaded first)
    assert plan.sources == ("w2", "w1", "w0") and plan.receivers == ("w3",)
    assert [t.receives for t in plan.loads] == [False, True]
    assert plan.link_gbps == 25.0  # the median of the sources' and receivers' links (5, 25, 25, 100)
    assert plan.record()["sources"] == ["w2"] and plan.multicast.k == 1


def test_a_scale_out_adds_no_instance_on_a_worker_refusing_requests_but_a_first_instance_goes_anywhere():
    view = _one_copy_view("layercast")  # w0 serves, w1..w3 are free
    plan = plan_scale_out(view, _request(4), saturated={"w1", "w3"})
    assert plan.targets == ("w2",) and plan.to_instances == 2
    held = plan_scale_out(view, _request(4), saturated={"w1", "w2", "w3"})
    assert held.loads == () and held.held_back == ("w1", "w2", "w3")
    assert plan_scale_out(view, _request(4)).held_back == ()
    # No instance live: one must go somewhere for the model's requests to get in; the others first.
    cold = _view([_worker(f"w{i}") for i in range(3)], [_model("layercast")])
    assert plan_scale_out(cold, _request(3), saturated={"w0"}).targets == ("w1", "w2", "w0")
    assert decide(cold, _request(1), saturated={"w0", "w1", "w2"}).targets == ("w0",)


def test_no_copy_anywhere_means_every_target_reads_its_disk():
    view = _view([_worker("w0"), _worker("w1")], [_model("layercast")])
    plan = plan_scale_out(view, _request(2))
    assert plan.targets == ("w0", "w1") and plan.multicast is None and not any(t.receives for t in plan.loads)


def test_no_free_worker_is_a_plan_without_loads():
    view = _view([_worker("w0"), _worker("w1", alive=False)], [_model()], _copy("w0"), [_instance("i0", "w0")])
    plan = plan_scale_out(view, _request(2))
    assert plan is not None and plan.loads == () and plan.desired == 2


def test_a_scale_in_drains_loading_instances_first_and_serverlessllm_keeps_the_host_cache():
    instances = [_instance("i0", "w0"), _instance("i1", "w1", m.InstanceState.loading), _instance("i2", "w2"),
                 _instance("gone", "w3", m.InstanceState.stopped)]
    workers = [_worker(f"w{i}") for i in range(4)]
    for mode, keep in [("serverlessllm", 7.0), ("layercast", None)]:
        scale_in = decide(_view(workers, [_model(mode)], instances=instances), _request(1), {"w0": 3},
                          host_keep_alive_s=7.0)
        assert isinstance(scale_in, ScaleIn)
        assert [i.instance_id for i in scale_in.victims] == ["i1", "i2"]
        assert (scale_in.from_instances, scale_in.desired, scale_in.host_keep_alive_s) == (3, 1, keep)
        assert scale_in.record() == {"kind": "drain", "victims": ["i1", "i2"]}


def test_a_deleted_model_loses_every_instance():
    view = _view([_worker("w0")], [], instances=[_instance("i0", "w0")])
    assert plan_scale_out(view, _request(2)) is None
    scale_in = decide(view, _request(2))
    assert scale_in.desired == 0 and [i.instance_id for i in scale_in.victims] == ["i0"]
    assert scale_in.host_keep_alive_s is None


def test_a_load_command_carries_the_targets_parameters():
    t = target_load("serverlessllm", "w1", 1, 3)
    cmd = t.command(_model("serverlessllm"), "inst-1", "op-1")
    assert (cmd.instance_id, cmd.model, cmd.path, cmd.block_start, cmd.block_end, cmd.scale_op_id) == \
        ("inst-1", "m", "/models/m", 1, 3, "op-1")
    assert (cmd.preheld, cmd.serve_while_loading, cmd.incoming_transfer) == (False, False, None)


# --- properties over random views -----------------------------------------------------------------

WORKER_IDS = [f"w{i}" for i in range(6)]


@st.composite
def clusters(draw):
    mode = draw(st.sampled_from(list(MODES)))
    n_blocks = draw(st.integers(1, 4))
    max_instances = draw(st.integers(1, 6))
    model = _model(mode, n_blocks, draw(st.integers(0, max_instances)), max_instances)
    workers = [_worker(w, draw(st.sampled_from([1.0, 10.0, 100.0])), alive=draw(st.booleans()) or w == "w0")
               for w in WORKER_IDS[: draw(st.integers(1, 6))]]
    serving = draw(st.booleans())  # w0 serves from its host copy: a source for any scale-out
    replicas = []
    for w in workers:
        if w.worker_id == "w0" and serving or draw(st.integers(0, 3)) == 0:  # a whole host copy
            replicas += _copy(w.worker_id, n_blocks)
        else:
            replicas += [m.ReplicaInfo(model="m", block_id=b, worker_id=w.worker_id,
                                       tier=draw(st.sampled_from(list(m.Tier))),
                                       state=draw(st.sampled_from([m.ReplicaState.ready, m.ReplicaState.loading])))
                         for b in range(n_blocks) if draw(st.booleans())]
    states = st.sampled_from([None, *m.InstanceState])
    instances = []
    for w in workers:
        state = m.InstanceState.ready if w.worker_id == "w0" and serving else draw(states)
        if state is not None:
            instances.append(_instance(f"i-{w.worker_id}", w.worker_id, state))
    deleted = draw(st.integers(0, 9)) == 0
    view = _view(workers, [] if deleted else [model], replicas, instances)
    load = {w.worker_id: draw(st.integers(0, 5)) for w in workers}
    return view, model, deleted, load, draw(st.integers(0, 8))


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_plans_respect_the_view(cluster):
    view, model, deleted, load, requested = cluster
    request = _request(requested)
    live = [i for i in view.instances if i.state in (m.InstanceState.loading, m.InstanceState.ready)]
    alive = [w.worker_id for w in view.workers if w.state == "alive"]
    free = set(alive) - {i.entry_worker for i in live}
    spec = MODES[model.scaling_mode]
    desired = 0 if deleted else model.min_instances if spec.fixed_at_min else \
        max(model.min_instances, min(requested, model.max_instances))
    if not deleted:
        assert model.min_instances <= desired <= model.max_instances

    out = plan_scale_out(view, request, load)
    scale_in = plan_scale_in(view, request, load)
    decision = decide(view, request, load)
    if desired > len(live) and not deleted:
        assert out is not None and scale_in is None and decision == out
        assert out.desired == desired
        assert len(out.targets) == len(set(out.targets)) <= min(len(free), desired - len(live))
        assert set(out.targets) <= free
        copies = set(full_copies(range(len(model.blocks)), held_blocks(view, "m"), alive))
        assert set(out.sources) == (copies if out.targets else set())  # a target holding a copy sends too
        assert list(out.receivers) == [t for t in out.targets if t not in copies]
        if out.multicast is not None:
            assert spec.multicast is not None and 1 <= out.multicast.k <= len(out.sources)
            assert [t.worker_id for t in out.loads if t.receives] == list(out.receivers)
            assert out.record()["kind"] == "multicast"
        else:
            assert not any(t.receives for t in out.loads)
        in_pipeline = {w for p in out.pipelines for w in p}
        assert all((t.preheld, t.serve_while_loading) ==
                   (spec.preheld, spec.serve_while_loading and t.worker_id not in in_pipeline)
                   for t in out.loads)
        assert all(set(p) <= set(out.receivers) and len(p) >= 2 for p in out.pipelines)
        assert not out.pipelines or (spec.pipelines and out.multicast.algorithm == "binomial")
    elif desired < len(live):
        assert out is None and scale_in is not None and decision == scale_in
        victims = [i.instance_id for i in scale_in.victims]
        assert len(victims) == len(set(victims)) == len(live) - desired
        assert set(victims) <= {i.instance_id for i in live}
        keeps = not deleted and spec.host_keep_alive_on_scale_in
        assert scale_in.host_keep_alive_s == (SERVERLESSLLM_KEEP_ALIVE_S if keeps else None)
    else:
        assert out is None and scale_in is None and decision is None


# --- chains planned on the view's topology (libs.planning.chain) -----------------------------------


def _placed(wid: str, leaf: str, group: str = "", link_gbps: float = 10.0,
            measured_gbytes: float | None = None) -> m.WorkerInfo:
    return m.WorkerInfo(worker_id=wid, data_address=f"{wid}:7000",
                        topology=m.Topology(host=wid, leaf=leaf, scaleup_group=group, link_gbps=link_gbps),
                        bandwidths_gbps={} if measured_gbytes is None else {"network_to_host": measured_gbytes},
                        capacities={m.Tier.host: 1 << 30}, state="alive", last_heartbeat=0.0)


def _chains(plan: ScalePlan) -> list[list[str]]:
    """The plan's chains as worker ids, read off its schedule (who sends block 0 to whom)."""
    nodes = plan.nodes()
    parent = {t.dst: t.src for t in plan.multicast.schedule if t.block == 0}
    child = {s: d for d, s in parent.items()}
    chains = []
    for head in range(plan.multicast.k):
        chain = [head]
        while chain[-1] in child:
            chain.append(child[chain[-1]])
        chains.append([nodes[v] for v in chain])
    return chains


def _two_leaf_view(mode: str, instances=(), model: m.ModelInfo | None = None) -> m.ClusterView:
    """w0..w7 on two leaves round-robin (w0, w2, ... on leaf-0); w0 and w1 hold the host copy."""
    workers = [_placed(f"w{i}", f"leaf-{i % 2}") for i in range(8)]
    model = model or _model(mode, max_instances=8)
    n = len(model.blocks)
    return _view(workers, [model], _copy("w0", n) + _copy("w1", n),
                 list(instances) or [_instance("i0", "w0"), _instance("i1", "w1")])


def test_chain_mode_plans_one_chain_per_leaf_from_the_views_topology():
    plan = plan_scale_out(_two_leaf_view("chain"), _request(8))
    assert plan.multicast.algorithm == "chain" and sorted(plan.receivers) == [f"w{i}" for i in range(2, 8)]
    assert sorted(_chains(plan)) == [["w0", "w2", "w4", "w6"], ["w1", "w3", "w5", "w7"]]
    validate_schedule(plan.multicast.schedule, len(plan.nodes()), N_BLOCKS, sources=range(plan.multicast.k))
    assert plan.record()["predicted"]["completion_s"] > 0  # read off these chains


def test_chain_blind_walks_the_targets_in_worker_id_order_across_leaves():
    plan = plan_scale_out(_two_leaf_view("chain-blind"), _request(8))
    assert plan.multicast.algorithm == "chain-blind"
    assert _chains(plan) == [["w0", "w2", "w3", "w4"], ["w1", "w5", "w6", "w7"]]


def test_a_scaleup_group_is_fed_by_one_of_its_members():
    workers = [_placed("w0", "leaf-0"), _placed("w1", "leaf-0", "nv"), _placed("w2", "leaf-0"),
               _placed("w3", "leaf-0", "nv")]
    view = _view(workers, [_model("chain")], _copy("w0"), [_instance("i0", "w0")])
    plan = plan_scale_out(view, _request(4))
    assert _chains(plan) == [["w0", "w1", "w3", "w2"]]  # w3 gets its blocks from w1, in its group


def _pipeline(iid: str, *wids: str) -> m.InstanceInfo:
    stages = [m.Stage(worker_id=w, block_start=i, block_end=i + 1) for i, w in enumerate(wids)]
    return m.InstanceInfo(instance_id=iid, model="other", mode="pipeline", stages=stages,
                          state=m.InstanceState.ready, created_at=0.0)


def test_a_source_serving_a_pipeline_stage_is_pruned_while_another_source_exists():
    view = _two_leaf_view("chain", [_instance("i0", "w0"), _instance("i1", "w1"), _pipeline("p", "w0", "w7")])
    # w0 is the least loaded (it would go first) but streams activations to w7's stage.
    plan = plan_scale_out(view, _request(5), load={"w1": 3})
    assert plan.senders == ("w1",) and plan.sources == ("w1", "w0")
    assert all(chain[0] == "w1" for chain in _chains(plan))
    assert plan.record()["sources"] == ["w1"]
    # Without the pipeline w0 sends too (least loaded first).
    plain = plan_scale_out(_two_leaf_view("chain"), _request(5), load={"w1": 3})
    assert plain.senders == ("w0", "w1")


def test_when_every_source_serves_a_pipeline_they_send_anyway():
    view = _two_leaf_view("chain", [_instance("i0", "w0"), _instance("i1", "w1"), _pipeline("p", "w0", "w1")])
    assert set(plan_scale_out(view, _request(4)).senders) == {"w0", "w1"}


def test_the_cost_model_uses_the_measured_link_rates_and_the_default_where_none_is_measured():
    def view(measured):
        workers = [_placed(f"w{i}", "leaf-0", measured_gbytes=measured) for i in range(4)]
        return _view(workers, [_model("layercast")], _copy("w0"), [_instance("i0", "w0")])

    fast, slow = plan_scale_out(view(None), _request(4)), plan_scale_out(view(0.25), _request(4))
    assert fast.link_gbps == 10.0 and slow.link_gbps == 2.0  # 0.25 GB/s measured is 2 Gbit/s
    assert slow.prediction["completion_s"] > fast.prediction["completion_s"]
    assert slow.prediction == predicted(slow.multicast, 3, 4 << 20, N_BLOCKS, 2.0)


def test_layercast_choosing_chains_plans_them_on_the_topology():
    # One 64 MiB block, 2 copies -> 6 targets: chains finish first (chunk relay) and no
    # pipeline forms sooner, so layercast picks them.
    model = _model("layercast", n_blocks=1, max_instances=8)
    model = model.model_copy(update={"blocks": [model.blocks[0].model_copy(update={"nbytes": 64 << 20})]})
    plan = plan_scale_out(_two_leaf_view("layercast", model=model), _request(8))
    assert plan.multicast.algorithm == "chain"
    assert sorted(_chains(plan)) == [["w0", "w2", "w4", "w6"], ["w1", "w3", "w5", "w7"]]


@st.composite
def _topology_views(draw):
    """Chain-planned scale-outs on any topology: 2-9 workers on 1-3 leaves, some in scale-up
    groups, some measured; 1-3 hold the copy; some serve stages of another model's pipeline."""
    n = draw(st.integers(2, 9))
    workers = [_placed(f"w{i}", f"leaf-{draw(st.integers(0, 2))}", draw(st.sampled_from(["", "nv0", "nv1"])),
                       measured_gbytes=draw(st.sampled_from([None, 0.1, 1.0]))) for i in range(n)]
    holders = [f"w{i}" for i in range(draw(st.integers(1, min(3, n - 1))))]
    staged = [f"w{i}" for i in range(n) if draw(st.booleans())]
    instances = [_instance(f"i{i}", w) for i, w in enumerate(holders)]
    if len(staged) >= 2:
        instances.append(_pipeline("p", *staged))
    mode = draw(st.sampled_from(["chain", "chain-blind", "layercast"]))
    replicas = [r for w in holders for r in _copy(w)]
    return _view(workers, [_model(mode, max_instances=n)], replicas, instances), set(holders), set(staged)


@settings(max_examples=100, deadline=None)
@given(_topology_views())
def test_chains_planned_on_any_topology_are_valid_plans_from_quiet_sources(case):
    view, holders, staged = case
    plan = plan_scale_out(view, _request(len(view.workers)))
    if plan is None or plan.multicast is None or plan.multicast.algorithm not in ("chain", "chain-blind"):
        return
    nodes = plan.nodes()
    assert len(nodes) == len(set(nodes)) and set(plan.senders) <= holders
    validate_schedule(plan.multicast.schedule, len(nodes), N_BLOCKS, sources=range(plan.multicast.k))
    if len(staged) >= 2 and holders - staged:
        assert not set(plan.senders) & staged  # a quiet source exists: no stage worker sends


# --- blitzscale: live pairs at a scale-out's start (BlitzScale §5.2) ----------------------------------


def _loaded_instance(iid: str, wid: str) -> m.InstanceInfo:
    return _instance(iid, wid).model_copy(update={"loaded_at": 0.0})


def _blitz_view(mode: str = "blitzscale", ttft_slo_s: float | None = 1e-4, live_pairs=()) -> m.ClusterView:
    """The two-leaf cluster; w0 and w1 serve every block (the sources); a TTFT SLO shorter than
    any chain's load, so every receiver is worth pairing unless said otherwise."""
    model = _model(mode, max_instances=8).model_copy(update={"ttft_slo_s": ttft_slo_s})
    view = _two_leaf_view(mode, [_loaded_instance("i0", "w0"), _loaded_instance("i1", "w1")], model=model)
    return view.model_copy(update={"live_pairs": list(live_pairs)})


def test_blitzscale_pairs_each_serving_instance_with_a_chain_tail_and_loads_stop_the_world():
    plan = plan_scale_out(_blitz_view(), _request(8), load={"w1": 5})
    assert plan.multicast.algorithm == "chain"
    tails = {chain[-1] for chain in _chains(plan)}
    assert len(plan.live_pairs) == 2
    assert {p.target_worker for p in plan.live_pairs} == tails  # the slowest receivers: the chains' tails
    assert {p.source_instance for p in plan.live_pairs} == {"i0", "i1"}
    assert plan.live_pairs[0].source_worker == "w1"  # the busiest source pairs first
    assert all(not load.serve_while_loading for load in plan.loads)
    assert plan.record()["live_pairs"][0]["target_worker"] in tails


def test_no_pair_where_the_chain_loads_within_the_sources_slo_or_the_mode_has_none():
    assert plan_scale_out(_blitz_view(ttft_slo_s=None), _request(8)).live_pairs == ()  # 2 s: MiB load faster
    for mode in ("chain", "blitzscale-nopairs"):
        plan = plan_scale_out(_blitz_view(mode), _request(8))
        assert plan.multicast.algorithm == "chain" and plan.live_pairs == ()
    assert MODES["blitzscale-nopairs"].keeps_pool and not MODES["blitzscale-nopairs"].serve_while_loading


def test_a_source_in_a_live_pair_is_pruned_as_a_chain_source_and_not_paired_again():
    pair = m.LivePairInfo(source_instance="i0", source_worker="w0", target_instance="i9", target_worker="w9")
    view = _blitz_view(live_pairs=[pair])
    assert live_pair_workers(view) == {"w0", "w9"}
    # w0 is the least loaded (it would go first) but its link carries its pair's traffic.
    plan = plan_scale_out(view, _request(5), load={"w1": 3})
    assert plan.senders == ("w1",) and all(chain[0] == "w1" for chain in _chains(plan))
    assert [p.source_instance for p in plan.live_pairs] == ["i1"]
    assert plan_scale_out(_blitz_view(), _request(5), load={"w1": 3}).senders == ("w0", "w1")


@st.composite
def _pairing_views(draw):
    """blitzscale views on 3-9 workers: some serve (loaded or not), 1-3 hold the copy, some are
    already in live pairs; any TTFT SLO."""
    n = draw(st.integers(3, 9))
    workers = [_placed(f"w{i}", f"leaf-{draw(st.integers(0, 1))}") for i in range(n)]
    holders = [f"w{i}" for i in range(draw(st.integers(1, n - 1)))]
    instances = [_loaded_instance(f"i{i}", w) if draw(st.booleans()) else _instance(f"i{i}", w)
                 for i, w in enumerate(holders)]
    pairs = [m.LivePairInfo(source_instance=i.instance_id, source_worker=i.entry_worker, target_instance="x",
                            target_worker=f"w{n - 1}") for i in instances if draw(st.booleans())][:1]
    model = _model("blitzscale", max_instances=n).model_copy(
        update={"ttft_slo_s": draw(st.sampled_from([1e-4, 0.01, None]))})
    view = _view(workers, [model], [r for w in holders for r in _copy(w)], instances)
    return view.model_copy(update={"live_pairs": pairs}), draw(st.integers(len(holders) + 1, n))


@settings(max_examples=100, deadline=None)
@given(case=_pairing_views())
def test_live_pairs_join_an_unpaired_serving_source_and_a_chain_receiver_one_pair_each(case):
    view, desired = case
    plan = plan_scale_out(view, _request(desired))
    if plan is None or not plan.live_pairs:
        return
    serving = {i.instance_id: i.entry_worker for i in view.instances if i.loaded_at is not None}
    busy = live_pair_workers(view)
    sources = [p.source_instance for p in plan.live_pairs]
    targets = [p.target_worker for p in plan.live_pairs]
    assert len(set(sources)) == len(sources) and len(set(targets)) == len(targets)
    for p in plan.live_pairs:
        assert serving.get(p.source_instance) == p.source_worker and p.source_worker not in busy
        assert p.target_worker in plan.receivers and p.target_worker not in busy
        assert p.target_worker != p.source_worker
    assert all(not load.serve_while_loading for load in plan.loads)
