"""Parameter-pool repair: after applying what pool_repair returns, a complete host copy exists."""

from hypothesis import given
from hypothesis import strategies as st

from libs.planning.placement import Held, full_copies
from libs.planning.pool import PoolFill, host_holdings, pool_repair

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
