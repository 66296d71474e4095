"""The parameter pool (BlitzScale §5.3) restores a lost host copy, as processes on loopback.

A deployment at zero instances keeps its one complete host copy on a single worker (the
holder). Nothing else brings the model into a host tier: no request comes, so no instance is
created and no worker loads it. When the holder's process dies, only the planner's
re-replication (its pool check on the worker's expiry, or the periodic one) can put a complete
copy back, on a survivor that held none of it.

No root needed (no emulation): real NATS, Postgres and service processes, three workers.
"""

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from libs.checkpoint import CheckpointIndex
from libs.planning.scaleout import alive_workers
from conftest import cluster_view, described, running_cluster, wait_for

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
HEARTBEAT_TTL_S = 3.0  # the registry expires the dead holder within seconds (workers beat every 1 s)
RESTORE_WITHIN_S = 30.0  # kill -> complete host copy on a survivor: expiry + pool check + a disk read


@pytest.fixture
def cluster(tmp_path, nats_url, postgres_server_url, tiny_checkpoint):
    # min_instances=0 and no request: the model stays at zero instances for the whole test. Its
    # own namespace: nothing else on the shared NATS server sends it scale requests.
    with running_cluster(
            postgres_server_url, tiny_checkpoint,
            dict(min_instances=0, max_instances=3, keep_alive_s=600, scaling_mode="layercast"),
            state_dir=tmp_path / "cluster", api_key=API_KEY, admin_key=ADMIN_KEY, workers=3, nats_url=nats_url,
            namespace=f"lcp{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=HEARTBEAT_TTL_S) as state:
        yield state


def host_copies(cluster) -> dict[str, set[int]]:
    """worker -> the blocks of tiny the registry records ready in its host tier."""
    held: dict[str, set[int]] = {}
    for r in described(cluster)["replicas"]:
        if r["tier"] == "host" and r["state"] == "ready":
            held.setdefault(r["worker_id"], set()).add(r["block_id"])
    return held


def pool_copy_lines(cluster, worker: str) -> list[str]:
    """The planner's log lines saying a pool copy of tiny was put on `worker`."""
    planner = next(p for p in cluster.processes if p.name == "planner")
    text = Path(planner.log).read_text(errors="replace")
    return [line for line in text.splitlines() if f"pool copy of tiny: {worker} keeps blocks" in line]


def test_a_lost_pool_copy_is_re_replicated_onto_a_survivor(cluster, tiny_checkpoint):
    every_block = {b.id for b in CheckpointIndex.load(tiny_checkpoint).blocks}
    workers = wait_for(lambda: w if len(w := set(alive_workers(cluster_view(cluster)))) == 3 else None, 30,
                       "three alive workers")

    # At deploy the pool puts the one copy on one worker (from its disk); nobody else holds any of it.
    def complete_somewhere() -> dict[str, set[int]] | None:
        held = host_copies(cluster)
        return held if every_block in held.values() else None
    copies = wait_for(complete_somewhere, 30, "the pool's host copy at deploy")
    (holder,) = [w for w, b in copies.items() if b == every_block]
    assert set(copies) == {holder}, copies  # exactly one holder: a survivor's copy can only come from re-replication
    wait_for(lambda: pool_copy_lines(cluster, holder), 10, "the planner's log of the deploy-time pool copy")
    survivors = workers - {holder}
    time.sleep(2 * HEARTBEAT_TTL_S)  # nothing else moves the model meanwhile (no instance, no other copy)
    assert described(cluster)["instances"] == []
    assert set(host_copies(cluster)) == {holder}
    assert all(not pool_copy_lines(cluster, w) for w in survivors)

    proc = next(p for p in cluster.processes if p.name == holder)
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: holder not in alive_workers(cluster_view(cluster)), 3 * HEARTBEAT_TTL_S + 5,
             "the holder's heartbeat expiry")

    def restored() -> str | None:
        held = host_copies(cluster)
        return next((w for w in sorted(survivors) if held.get(w) == every_block), None)
    target = wait_for(restored, RESTORE_WITHIN_S, "a complete host copy on a survivor")
    took = time.monotonic() - killed
    print(f"\nholder {holder} killed; complete host copy on {target} {took:.1f} s later")

    # It came from the planner's re-replication: it commanded that survivor to keep the blocks,
    # and still no instance exists that could have loaded them.
    lines = pool_copy_lines(cluster, target)
    assert lines and f"keeps blocks {sorted(every_block)}" in lines[-1], lines
    assert described(cluster)["instances"] == []
    # Every block of it is recorded ready in the survivor's host tier (pinned: it stays).
    time.sleep(1.0)
    assert host_copies(cluster).get(target) == every_block
