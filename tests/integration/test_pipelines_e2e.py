"""Serving while the model is still arriving (λScale §4.3-4.4), as processes, without root:
each worker paces its data-plane sends in process (LAYERCAST_EMULATED_LINK_MBIT). The
scenarios are in tests/pipeline_scenarios.py; tests/emulated runs them over capped links."""

import pytest

import pipeline_scenarios as scenario
from conftest import running_cluster
from libs.protocol import subjects

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    return scenario.four_blocks(tmp_path_factory)


def _cluster(tmp_path_factory, nats_url, postgres_server_url, checkpoint, ttl_s: float = 3.0,
             env: dict = scenario.CLUSTER_ENV):
    # Block sends paced in process (scenario.CLUSTER_ENV): the multicast takes seconds, so its
    # stages are visible and the pipeline serves for seconds.
    return running_cluster(
        postgres_server_url, checkpoint, scenario.DEPLOY,
        state_dir=tmp_path_factory.mktemp("cluster"), api_key=scenario.API_KEY, admin_key=scenario.ADMIN_KEY,
        workers=scenario.WORKERS, nats_url=nats_url, namespace=subjects.PREFIX, heartbeat_ttl_s=ttl_s,
        extra_env=env)


@pytest.fixture
def cluster(tmp_path_factory, nats_url, postgres_server_url, four_blocks):
    with _cluster(tmp_path_factory, nats_url, postgres_server_url, four_blocks) as state:
        yield state


@pytest.fixture
def slow_cluster(tmp_path_factory, nats_url, postgres_server_url, four_blocks):
    # A heartbeat TTL far beyond the test's waits: only a broken data-plane connection explains
    # a fast death (issue 40); no supervisor runs here to see the process exit.
    with _cluster(tmp_path_factory, nats_url, postgres_server_url, four_blocks, ttl_s=30.0,
                  env=scenario.KILL_CLUSTER_ENV) as state:
        yield state


def test_a_pipeline_serves_before_any_receiver_holds_the_model_then_switches(cluster, nats_url):
    scenario.serves_before_any_receiver_holds_the_model_then_switches(cluster, nats_url)


def test_a_stage_worker_killed_mid_request_loses_no_accepted_request(slow_cluster, nats_url):
    scenario.stage_worker_killed_mid_request_loses_no_accepted_request(slow_cluster, nats_url, unreachable_death=True)
