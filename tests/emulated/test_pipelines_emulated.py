"""Execution pipelines on the emulated cluster: workers in network namespaces, every link
capped by tc (the data plane's own pacing is off), the scenarios of the in-process test
(tests/pipeline_scenarios.py): a pipeline forms before any receiver holds the model, serves,
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


def _cluster(tmp_path_factory, postgres_server_url, checkpoint, link_mbit: float, extra_env: dict | None = None):
    emulation = EmulatedCluster(scenario.WORKERS, link_mbit=link_mbit).start()
    try:
        with running_cluster(
                postgres_server_url, checkpoint, scenario.DEPLOY, emulation=emulation,
                state_dir=tmp_path_factory.mktemp("cluster"), api_key=scenario.API_KEY,
                admin_key=scenario.ADMIN_KEY, workers=scenario.WORKERS, namespace=subjects.PREFIX, heartbeat_ttl_s=3.0,
                extra_env={"LAYERCAST_SCALE_DOWN_DELAY": "600", **(extra_env or {})}) as state:
            yield state
    finally:
        emulation.close()


@pytest.fixture
def cluster(tmp_path_factory, postgres_server_url, four_blocks):
    yield from _cluster(tmp_path_factory, postgres_server_url, four_blocks, 2)


@pytest.fixture
def slow_cluster(tmp_path_factory, postgres_server_url, four_blocks):
    # Heartbeats share the capped links with the multicast: at a fraction of a Mbit/s a busy
    # source misses its 3 s heartbeat deadline and is taken for dead (its instances with it).
    # So the links run at 16 Mbit/s and the data plane alone is paced slower, in process, to
    # keep the pipeline serving for seconds before the receivers complete.
    yield from _cluster(tmp_path_factory, postgres_server_url, four_blocks, 16,
                        {"LAYERCAST_EMULATED_LINK_MBIT": "0.7"})


def test_a_pipeline_forms_serves_and_switches_over_capped_links(cluster):
    scenario.serves_before_any_receiver_holds_the_model_then_switches(cluster, cluster.nats_url)


def test_a_stage_worker_killed_mid_request_loses_no_request_over_capped_links(slow_cluster):
    scenario.stage_worker_killed_mid_request_loses_no_accepted_request(slow_cluster, slow_cluster.nats_url)
