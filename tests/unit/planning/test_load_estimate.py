"""Scale-out targets chosen by the ServerlessLLM §6.2 load-time estimate (libs/planning/
load_estimate.py, placement.pick_targets, scaleout.plan_scale_out): locality and the loads
already queued on a worker weighed together, in its own measured bandwidths."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.planning.load_estimate import (
    DEFAULT_HOST_TO_DEVICE_GBPS,
    DEFAULT_SSD_TO_HOST_GBPS,
    estimated_load_s,
    worker_bandwidths,
)
from libs.planning.placement import Candidate, load_time_rank, pick_targets
from libs.planning.scaleout import plan_scale_out
from libs.protocol import messages as m

GB = 10**9
N_BLOCKS = 4
BLOCK = GB // 4  # a 1 GB model: its load takes seconds, far above the estimate's resolution


def worker(wid: str, link_gbps: float = 10.0, **bandwidths_gbps: float) -> m.WorkerInfo:
    return m.WorkerInfo(worker_id=wid, data_address=f"{wid}:7000", topology=m.Topology(host=wid, link_gbps=link_gbps),
                        capacities={m.Tier.host: 64 * GB}, bandwidths_gbps=bandwidths_gbps, state="alive",
                        last_heartbeat=0.0)


def model(name: str = "m", block: int = BLOCK, mode: str = "serverlessllm") -> m.ModelInfo:
    blocks = [m.BlockInfo(block_id=b, nbytes=block, checksum="", layer_start=b, layer_end=b + 1)
              for b in range(N_BLOCKS)]
    return m.ModelInfo(name=name, path=f"/models/{name}", arch="toy", n_layers=N_BLOCKS, blocks=blocks,
                       max_instances=8, scaling_mode=mode, state=m.ModelState.deployed, created_at=0.0)


def copy(wid: str, tier: m.Tier, name: str = "m", blocks=range(N_BLOCKS)) -> list[m.ReplicaInfo]:
    return [m.ReplicaInfo(model=name, block_id=b, worker_id=wid, tier=tier, state=m.ReplicaState.ready)
            for b in blocks]


def loading(iid: str, wid: str, name: str, state=m.InstanceState.loading, loaded_at=None) -> m.InstanceInfo:
    return m.InstanceInfo(instance_id=iid, model=name, state=state, created_at=0.0, loaded_at=loaded_at,
                          stages=[m.Stage(worker_id=wid, block_start=0, block_end=N_BLOCKS)])


def view(workers, models=(), replicas=(), instances=()) -> m.ClusterView:
    return m.ClusterView(workers=list(workers), models=list(models) or [model()], replicas=list(replicas),
                         instances=list(instances), scale_ops=[])


def targets(v: m.ClusterView, n: int) -> tuple[str, ...]:
    plan = plan_scale_out(v, m.ScaleRequest(model="m", desired_instances=n, reason="test"))
    return plan.targets


# --- the estimate ---------------------------------------------------------------------------------


def test_bandwidths_are_the_measured_ones_and_defaults_until_measured():
    bw = worker_bandwidths(worker("w", link_gbps=40.0, ssd_to_host=7.0))
    assert bw.ssd_to_host == 7.0 * GB
    assert bw.host_to_device == DEFAULT_HOST_TO_DEVICE_GBPS * GB
    assert bw.network_to_host == 40.0 / 8 * GB  # the advertised link until measured
    assert worker_bandwidths(worker("w")).ssd_to_host == DEFAULT_SSD_TO_HOST_GBPS * GB


def test_the_estimate_charges_each_block_from_its_nearest_tier():
    v = view([worker("w", ssd_to_host=2.0, host_to_device=20.0, network_to_host=1.0)],
             replicas=copy("w", m.Tier.ssd) + copy("w", m.Tier.host, blocks=[0]) + copy("w", m.Tier.gpu, blocks=[1]))
    # block 0 from host (20 GB/s), block 1 already in engine memory, blocks 2-3 from the SSD (2 GB/s)
    assert estimated_load_s(v, model(), ["w"])["w"] == pytest.approx(BLOCK / (20 * GB) + 2 * BLOCK / (2 * GB))


def test_the_queue_is_what_the_loads_running_there_still_take():
    other = model("other")
    busy = view([worker("w", network_to_host=1.0)], [model(), other],
                replicas=copy("w", m.Tier.gpu, "other", blocks=[0, 1]),
                instances=[loading("i1", "w", "other")])
    idle = view([worker("w", network_to_host=1.0)], [model(), other])
    # "other" has blocks 2-3 left to load over the network: the new load waits for them.
    alone = estimated_load_s(idle, model(), ["w"])["w"]
    assert estimated_load_s(busy, model(), ["w"])["w"] == pytest.approx(alone + 2 * BLOCK / GB)
    # Serving while it loads still loads; once loaded (or serving no more) it queues nothing.
    serving = busy.model_copy(update={"instances": [loading("i1", "w", "other", m.InstanceState.ready)]})
    assert estimated_load_s(serving, model(), ["w"]) == estimated_load_s(busy, model(), ["w"])
    for done in (loading("i1", "w", "other", m.InstanceState.ready, loaded_at=1.0),
                 loading("i1", "w", "other", m.InstanceState.stopped)):
        assert estimated_load_s(busy.model_copy(update={"instances": [done]}), model(), ["w"]) == \
            estimated_load_s(idle, model(), ["w"])


# --- the ranking ----------------------------------------------------------------------------------


def test_host_memory_beats_local_ssd_beats_nothing_with_the_same_bandwidths():
    # Ids in the opposite order: only the estimate puts the host holder first.
    v = view([worker("a-none"), worker("b-ssd"), worker("c-host")],
             replicas=copy("b-ssd", m.Tier.ssd) + copy("c-host", m.Tier.host))
    assert targets(v, 3) == ("c-host", "b-ssd", "a-none")


def test_a_faster_measured_disk_wins_among_workers_with_the_model_on_ssd():
    v = view([worker("a-slow", ssd_to_host=1.0), worker("b-fast", ssd_to_host=6.0)],
             replicas=copy("a-slow", m.Tier.ssd) + copy("b-fast", m.Tier.ssd))
    assert targets(v, 1) == ("b-fast",)


def test_a_long_load_queue_makes_the_closer_worker_lose():
    big = model("big", block=8 * GB)  # 32 GB still to load over the network on a-host
    small = model("small", block=GB // 1000)
    holders = copy("a-host", m.Tier.host)
    long_queue = view([worker("a-host"), worker("b-none")], [model(), big], holders, [loading("i1", "a-host", "big")])
    assert targets(long_queue, 1) == ("b-none",)
    short_queue = view([worker("a-host"), worker("b-none")], [model(), small], holders,
                       [loading("i1", "a-host", "small")])
    assert targets(short_queue, 1) == ("a-host",)


def test_ties_keep_todays_order_locality_then_load_then_id():
    # Same estimate everywhere (nothing held, same links): fewer instances first, then the id.
    v = view([worker("w3"), worker("w1"), worker("w2")], instances=[
        m.InstanceInfo(instance_id="x", model="other", state=m.InstanceState.ready, created_at=0.0, loaded_at=0.0,
                       stages=[m.Stage(worker_id="w1", block_start=0, block_end=1)])],
        models=[model(), model("other")])
    assert targets(v, 3) == ("w2", "w3", "w1")


def test_estimates_within_the_resolution_are_ties():
    assert load_time_rank({"a": 0.001, "b": 0.03}) == {"a": 0, "b": 0}  # both under 40 ms
    assert load_time_rank({"a": 10.0, "b": 10.5, "c": 11.0}) == {"a": 10, "b": 10, "c": 11}  # steps of 1 s


# --- properties -------------------------------------------------------------------------------------

rates = st.floats(0.05, 50.0, allow_nan=False)


@given(h2d=rates, ssd=rates, net=rates, ids=st.permutations(["w0", "w1", "w2"]))
def test_with_the_same_bandwidths_host_then_ssd_then_nothing(h2d, ssd, net, ids):
    # Wherever the disk is no slower than the network: the nearer tier never loses.
    ssd = max(ssd, net)
    none, on_ssd, in_host = ids
    links = {"host_to_device": h2d, "ssd_to_host": ssd, "network_to_host": net}
    v = view([worker(w, **links) for w in sorted(ids)],
             replicas=copy(on_ssd, m.Tier.ssd) + copy(in_host, m.Tier.host))
    assert targets(v, 3) == (in_host, on_ssd, none)


cluster_workers = st.lists(st.tuples(rates, rates, rates, st.sampled_from([None, "gpu", "host", "ssd"]),
                                     st.integers(0, 3)), min_size=1, max_size=5)


def _cluster(spec) -> m.ClusterView:
    ws, replicas, instances = [], [], []
    for i, (h2d, ssd, net, tier, queued_blocks) in enumerate(spec):
        wid = f"w{i}"
        ws.append(worker(wid, host_to_device=h2d, ssd_to_host=ssd, network_to_host=net))
        if tier:
            replicas += copy(wid, m.Tier(tier))
        if queued_blocks:  # another model loading there, some of its blocks already in
            replicas += copy(wid, m.Tier.gpu, "other", blocks=range(queued_blocks))
            instances.append(loading(f"i{i}", wid, "other"))
    return view(ws, [model(), model("other")], replicas, instances)


@given(cluster_workers, st.integers(1, 5))
def test_no_unchosen_worker_has_a_lower_estimate(spec, n):
    v = _cluster(spec)
    chosen = targets(v, n)
    rank = load_time_rank(estimated_load_s(v, model(), [w.worker_id for w in v.workers]))
    assert [rank[w] for w in chosen] == sorted(rank[w] for w in chosen)
    for w in rank:
        if w not in chosen:
            assert all(rank[c] <= rank[w] for c in chosen)


@given(cluster_workers, st.integers(1, 5), st.randoms(use_true_random=False))
def test_the_choice_does_not_depend_on_the_order_of_the_view(spec, n, rnd):
    v = _cluster(spec)
    shuffled = list(v.workers)
    rnd.shuffle(shuffled)
    replicas = list(v.replicas)
    rnd.shuffle(replicas)
    assert targets(v.model_copy(update={"workers": shuffled, "replicas": replicas}), n) == targets(v, n)


@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), st.floats(0, 100, allow_nan=False), min_size=1),
       st.integers(0, 4))
def test_pick_targets_takes_the_least_estimates_first(load_s, n):
    cands = [Candidate(w) for w in sorted(load_s)]
    chosen = pick_targets({0: 1}, cands, [], n, load_s=load_s)
    rank = load_time_rank(load_s)
    assert chosen == sorted(load_s, key=lambda w: (rank[w], w))[:n]
