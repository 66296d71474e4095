"""Execution pipelines on the emulated cluster: workers in network namespaces, every link
capped by tc (the blocks paced slower in process: see the fixture), the scenarios of the
in-process test (tests/pipeline_scenarios.py): a pipeline forms before any receiver holds the model, serves,
switches to local instances and retires; a stage worker killed mid-request loses no request.

Root only (skipped with the reason elsewhere); CI runs as root.
"""

import pytest

import pipeline_scenarios as scenario
from conftest import running_cluster
from libs.cluster.emulation import EmulatedCluster, can_emulate
from libs.protocol import subjects

_ok, _why = can_emulate()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(not _ok, reason=_why)]


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    return scenario.four_blocks(tmp_path_factory)


def _cluster(tmp_path_factory, postgres_server_url, four_blocks, env: dict):
    # Heartbeats share the capped links with the multicast: at a fraction of a Mbit/s a busy
    # source misses its 3 s heartbeat deadline and is taken for dead (its instances with it),
    # and a pipeline's activations wait behind blocks in tbf's queue (78 KB at 2 Mbit/s: up to
    # 0.3 s a hop). So the links run at 16 Mbit/s and the data plane alone is paced slower, in
    # process (scenario.CLUSTER_ENV), to keep the pipeline serving for seconds before the
    # receivers complete.
    emulation = EmulatedCluster(scenario.WORKERS, link_mbit=16).start()
    try:
        with running_cluster(
                postgres_server_url, four_blocks, scenario.DEPLOY, emulation=emulation,
                state_dir=tmp_path_factory.mktemp("cluster"), api_key=scenario.API_KEY,
                admin_key=scenario.ADMIN_KEY, workers=scenario.WORKERS, namespace=subjects.PREFIX, heartbeat_ttl_s=3.0,
                extra_env=env) as state:
            yield state
    finally:
        emulation.close()


@pytest.fixture
def cluster(tmp_path_factory, postgres_server_url, four_blocks):
    yield from _cluster(tmp_path_factory, postgres_server_url, four_blocks, scenario.CLUSTER_ENV)


@pytest.fixture
def kill_cluster(tmp_path_factory, postgres_server_url, four_blocks):
    yield from _cluster(tmp_path_factory, postgres_server_url, four_blocks, scenario.KILL_CLUSTER_ENV)


def test_a_pipeline_forms_serves_and_switches_over_capped_links(cluster):
    scenario.serves_before_any_receiver_holds_the_model_then_switches(cluster, cluster.nats_url)


def test_a_stage_worker_killed_mid_request_loses_no_request_over_capped_links(kill_cluster):
    scenario.stage_worker_killed_mid_request_loses_no_accepted_request(kill_cluster, kill_cluster.nats_url)
