"""Tests for ServerlessLLM §6 estimators and server choice (libs/planning/estimate.py)."""

from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.planning.estimate import (
    Bandwidths,
    ModelSpec,
    RunningInstance,
    RunningRequest,
    Tier,
    WorkerView,
    choose_server,
    inferred_output_tokens,
    instance_resume_time,
    load_time,
    migration_time,
    observe_load,
    path_bandwidth,
)

GB = 1e9
BW = Bandwidths(host_to_device=25 * GB, ssd_to_host=5 * GB, network_to_host=1.25 * GB)
A = ModelSpec("A", (GB,) * 10, resume_a_s=0.001, resume_b_s=0.2, time_per_token_s=0.05)
B = ModelSpec("B", (GB,) * 4, resume_a_s=0.001, resume_b_s=0.1, time_per_token_s=0.05)


def _all(model: ModelSpec, tier: Tier) -> dict[str, dict[int, Tier]]:
    return {model.name: {i: tier for i in range(len(model.block_bytes))}}


def test_load_time_uses_slowest_tier_on_path_and_queue() -> None:
    assert path_bandwidth(BW, Tier.HOST) == 25 * GB
    assert path_bandwidth(BW, Tier.SSD) == 5 * GB  # SSD, not PCIe, sets the pace
    assert path_bandwidth(BW, Tier.NETWORK) == 1.25 * GB
    host = WorkerView("h", BW, 1, _all(A, Tier.HOST))
    ssd = WorkerView("s", BW, 1, _all(A, Tier.SSD), queue_s=1.5)
    none = WorkerView("n", BW, 1)
    dev = WorkerView("d", BW, 1, _all(A, Tier.DEVICE), queue_s=9.0)
    assert load_time(host, A) == pytest.approx(10 / 25)
    assert load_time(ssd, A) == pytest.approx(1.5 + 10 / 5)  # q + n / b
    assert load_time(none, A) == pytest.approx(10 / 1.25)
    assert load_time(dev, A) == 0.0  # already loaded: no queue to wait in
    # Mixed locality: each block is charged to its own tier's path.
    mixed = WorkerView("m", BW, 1, {"A": {0: Tier.DEVICE, 1: Tier.HOST, 2: Tier.SSD}})
    assert load_time(mixed, A) == pytest.approx(1 / 25 + 1 / 5 + 7 / 1.25)


def test_migration_time_infers_output_tokens() -> None:
    assert inferred_output_tokens(2.0, 0.05) == 40
    assert inferred_output_tokens(0.04, 0.05) == 0
    assert migration_time(100, 40, 0.001, 0.2) == pytest.approx(0.34)
    inst = RunningInstance("A", 1, (RunningRequest(100, 2.0), RunningRequest(50, 1.0)))
    assert instance_resume_time(inst, A) == pytest.approx(0.001 * (100 + 40 + 50 + 20) + 0.2)
    with pytest.raises(ValueError):
        inferred_output_tokens(1.0, 0.0)


def test_choose_server_prefers_locality() -> None:
    workers = [
        WorkerView("net", BW, 1),
        WorkerView("ssd", BW, 1, _all(A, Tier.SSD)),
        WorkerView("host-busy-queue", BW, 1, _all(A, Tier.HOST), queue_s=5.0),
        WorkerView("host", BW, 1, _all(A, Tier.HOST)),
        WorkerView("full", BW, 0, _all(A, Tier.DEVICE)),
    ]
    p = choose_server(A, workers)
    assert p is not None and p.worker == "host" and not p.migrations
    assert p.estimate_s == pytest.approx(0.4)


def test_choose_server_migrates_only_when_nobody_is_free() -> None:
    busy = WorkerView(
        "w0", BW, 0, _all(A, Tier.HOST), running=(RunningInstance("B", 1, (RunningRequest(100, 2.0),)),)
    )
    spare = WorkerView("w1", BW, 1)
    # A free worker exists: load A there from the network (8 s), no migration.
    p = choose_server(A, [busy, spare], {"B": B})
    assert p is not None and p.worker == "w1" and p.migrations == ()
    # ServerlessLLM Fig. 5 style: migrating B away is faster overall.
    p = choose_server(A, [busy, spare], {"B": B}, always_consider_migration=True)
    assert p is not None and p.worker == "w0"
    (mig,) = p.migrations
    assert mig.dest == "w1" and mig.estimate_s == pytest.approx(4 / 1.25 + 0.001 * 140 + 0.1)
    assert p.estimate_s == pytest.approx(mig.estimate_s + 0.4)
    # Nobody free and nowhere to migrate to: keep the request pending.
    assert choose_server(A, [busy], {"B": B}) is None
    # Nobody free, but w1 has room for B: migrate.
    full = WorkerView("w2", BW, 0)
    p = choose_server(A, [busy, full, WorkerView("w3", BW, 1, _all(B, Tier.HOST), running=())], {"B": B})
    assert p is not None and p.worker in ("w0", "w3")


@st.composite
def migration_cases(draw):  # type: ignore[no-untyped-def]
    running = tuple(
        RunningInstance(
            "B",
            draw(st.integers(min_value=1, max_value=3)),
            tuple(
                RunningRequest(draw(st.integers(0, 4000)), draw(st.floats(0, 30)))
                for _ in range(draw(st.integers(0, 3)))
            ),
        )
        for _ in range(draw(st.integers(min_value=1, max_value=6)))
    )
    # The new model needs more accelerators than any destination has free,
    # so only the busy worker can take it, after migrating instances away.
    model = ModelSpec("A", (GB,) * 4, gpus=draw(st.integers(min_value=4, max_value=6)))
    src = WorkerView("src", BW, 0, running=running)
    dests = [WorkerView(f"d{i}", BW, 3, _all(B, Tier.HOST)) for i in range(6)]
    return model, src, dests


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(migration_cases())
def test_migration_dp_matches_brute_force(case) -> None:  # type: ignore[no-untyped-def]
    model, src, dests = case
    assert choose_server(model, [src], {"B": B}) is None  # nowhere to migrate to
    p = choose_server(model, [src, *dests], {"B": B})
    # Brute force over every subset of instances that frees enough accelerators.
    per = [load_time(dests[0], B) + instance_resume_time(inst, B) for inst in src.running]
    best = None
    for r in range(1, len(src.running) + 1):
        for combo in combinations(range(len(src.running)), r):
            if sum(src.running[i].gpus for i in combo) >= model.gpus:
                cost = sum(per[i] for i in combo)
                best = cost if best is None else min(best, cost)
    if best is None:
        assert p is None
        return
    assert p is not None and p.worker == "src"
    assert sum(per[m.instance] for m in p.migrations) == pytest.approx(best)
    assert sum(src.running[m.instance].gpus for m in p.migrations) >= model.gpus
    # Parallel migrations: the model loads once the slowest one is done.
    assert p.estimate_s == pytest.approx(max(m.estimate_s for m in p.migrations) + load_time(src, model))
    # No destination receives more than it has room for.
    for d in dests:
        used = sum(src.running[m.instance].gpus for m in p.migrations if m.dest == d.id)
        assert used <= d.free_gpus


def test_observe_load_moves_bottleneck_estimate() -> None:
    bw = BW
    for _ in range(30):
        bw = observe_load(bw, Tier.SSD, int(10 * GB), 1.0)  # measured 10 GB/s
    assert bw.ssd_to_host == pytest.approx(10 * GB, rel=1e-3)
    assert bw.host_to_device == BW.host_to_device  # the other links are untouched
    one = observe_load(BW, Tier.HOST, int(5 * GB), 1.0, alpha=0.5)
    assert one.host_to_device == pytest.approx(15 * GB)
    assert observe_load(BW, Tier.DEVICE, 10, 1.0) == BW
    with pytest.raises(ValueError):
        observe_load(BW, Tier.HOST, 10, 1.0, alpha=0.0)
    with pytest.raises(ValueError):
        Bandwidths(0.0, 1.0, 1.0)
