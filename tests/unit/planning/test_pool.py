"""Parameter-pool repair: after applying what pool_repair returns, a complete host copy exists; the
planner's fills per scaling mode (plan_pool_fills)."""

from hypothesis import given
from hypothesis import strategies as st

from libs.planning.placement import Held, full_copies
from libs.planning.pool import PoolFill, free_host_bytes, host_holdings, plan_pool_fills, pool_repair
from libs.protocol import messages as m

WORKERS = ["w0", "w1", "w2", "w3"]


@st.composite
def clusters(draw):
    n_blocks = draw(st.integers(1, 6))
    block_bytes = {b: draw(st.integers(1, 100)) for b in range(n_blocks)}
    alive = draw(st.lists(st.sampled_from(WORKERS), min_size=1, max_size=4, unique=True))
    free = {w: draw(st.integers(0, 700)) for w in alive}
    held = [Held(w, b, draw(st.sampled_from(["host", "gpu"]))) for w in WORKERS for b in range(n_blocks)
            if draw(st.booleans())]
    return block_bytes, held, free


def apply(held: list[Held], fills: list[PoolFill]) -> list[Held]:
    return held + [Held(f.worker, b, "host") for f in fills for b in f.blocks]


@given(clusters())
def test_repair_restores_a_complete_copy_within_capacity(cluster):
    block_bytes, held, free = cluster
    fills = pool_repair(block_bytes, held, free)
    have = host_holdings(held, free)
    for f in fills:
        brought = set(f.from_peers) | set(f.from_disk)
        assert sum(block_bytes[b] for b in brought) <= free[f.worker]
        assert not brought & have.get(f.worker, set())  # nothing it already holds is brought again
        assert all(have[p] >= {b} and p != f.worker for b, p in f.from_peers.items())  # peers hold what they send
        assert set(f.from_peers).isdisjoint(f.from_disk)
    after = host_holdings(apply(held, fills), free)
    covered = set().union(*after.values()) if after else set()
    total = sum(block_bytes.values())
    if any(total - sum(block_bytes[b] for b in have.get(w, set())) <= free[w] for w in free):
        assert full_copies(block_bytes, apply(held, fills), free)  # one worker holds it all
    elif fills:
        assert covered > set().union(*have.values()) if have else covered


@given(clusters())
def test_nothing_to_do_once_a_worker_holds_every_block(cluster):
    block_bytes, held, free = cluster
    w = sorted(free)[0]
    held = held + [Held(w, b, "host") for b in block_bytes]
    assert pool_repair(block_bytes, held, free) == []


@given(clusters(), st.sets(st.sampled_from(WORKERS)))
def test_the_copy_is_kept_off_the_serving_workers_where_there_is_room(cluster, serving):
    block_bytes, held, free = cluster
    fills = pool_repair(block_bytes, held, free, serving)
    have = host_holdings(held, free)
    after = apply(held, fills)
    idle = [w for w in free if w not in serving]
    room = [w for w in idle if sum(block_bytes[b] for b in set(block_bytes) - have.get(w, set())) <= free[w]]
    if room:  # a worker serving nothing could hold a copy: afterwards one does
        assert set(full_copies(block_bytes, after, free)) - serving
    if full_copies(block_bytes, held, free):  # a serving worker's copy moves only to an idle one
        assert all(f.worker in idle for f in fills)


def test_a_copy_only_on_the_serving_worker_is_copied_to_an_idle_one_from_it():
    block_bytes = {0: 10, 1: 10}
    held = [Held("w0", 0, "host"), Held("w0", 1, "host")]
    assert pool_repair(block_bytes, held, {"w0": 100, "w1": 100}) == []  # nobody serves: it stays
    assert pool_repair(block_bytes, held, {"w0": 100, "w1": 100}, serving={"w0"}) == [
        PoolFill("w1", (0, 1), {0: "w0", 1: "w0"}, ())]
    # no idle worker has room: the serving worker's copy is the pool's
    assert pool_repair(block_bytes, held, {"w0": 100, "w1": 5}, serving={"w0"}) == []


def test_missing_blocks_come_from_survivors_before_the_disk():
    block_bytes = {0: 10, 1: 10, 2: 10}
    held = [Held("w1", 0, "host"), Held("w1", 1, "host"), Held("w2", 2, "host"), Held("dead", 2, "host")]
    fills = pool_repair(block_bytes, held, {"w1": 100, "w2": 100})
    assert fills == [PoolFill("w1", (0, 1, 2), {2: "w2"}, ())]
    # w2 gone as well: block 2 is read from w1's disk
    assert pool_repair(block_bytes, held, {"w1": 100}) == [PoolFill("w1", (0, 1, 2), {}, (2,))]


def test_spread_when_no_worker_has_room_for_the_whole_model():
    block_bytes = {0: 60, 1: 60, 2: 60}
    fills = pool_repair(block_bytes, [], {"a": 130, "b": 70})
    assert fills == [PoolFill("a", (0, 1), {}, (0, 1)), PoolFill("b", (2,), {}, (2,))]


# --- plan_pool_fills over the registry's view -------------------------------------------------------


def _view(modes: dict[str, str], copies: dict[str, list[str]], workers=("w0", "w1", "w2"),
          host_bytes: int = 1000) -> m.ClusterView:
    models = [m.ModelInfo(name=name, path=f"/models/{name}", arch="toy", n_layers=2, scaling_mode=mode,
                          blocks=[m.BlockInfo(block_id=b, nbytes=100, checksum="", layer_start=b, layer_end=b + 1)
                                  for b in range(2)], state=m.ModelState.deployed, created_at=0.0)
              for name, mode in modes.items()]
    replicas = [m.ReplicaInfo(model=name, block_id=b, worker_id=w, tier=m.Tier.host, state=m.ReplicaState.ready)
                for name, holders in copies.items() for w in holders for b in range(2)]
    return m.ClusterView(workers=[m.WorkerInfo(worker_id=w, data_address=f"{w}:1", topology=m.Topology(host=w),
                                               capacities={m.Tier.host: host_bytes}, state="alive",
                                               last_heartbeat=0.0) for w in workers],
                         models=models, replicas=replicas, instances=[], scale_ops=[])


def test_pool_fills_per_mode():
    modes = {"a": "layercast", "b": "serverlessllm", "c": "static", "d": "ideal", "e": "chain"}
    view = _view(modes, {"d": ["w1"], "e": ["w2"]})
    fills = [(model.name, fill) for model, fill in plan_pool_fills(view)]
    # No pool for serverlessllm and static; ideal wants a copy everywhere; e already has one.
    assert fills == [("a", PoolFill("w0", (0, 1), {}, (0, 1))),
                     ("d", PoolFill("w0", (0, 1), {}, (0, 1))), ("d", PoolFill("w2", (0, 1), {}, (0, 1)))]


def test_pool_fills_leave_out_models_with_open_operations_and_honour_only_model():
    view = _view({"a": "layercast", "d": "ideal"}, {})
    assert [x.name for x, _ in plan_pool_fills(view, open_models={"d"})] == ["a"]
    assert {x.name for x, _ in plan_pool_fills(view, only_model="d")} == {"d"}


def test_free_host_bytes_counts_ready_host_replicas_of_every_model():
    view = _view({"a": "layercast", "b": "chain"}, {"a": ["w0"], "b": ["w0", "w1"]}, host_bytes=500)
    assert free_host_bytes(view) == {"w0": 100, "w1": 300, "w2": 500}
