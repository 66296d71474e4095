"""Fault injection during a scale-out (issue 40): the entry stage of an execution pipeline is
SIGKILLed while it still receives the model by multicast (a worker mid-multicast) and serves
through the pipeline. The cluster is tests/pipeline_scenarios.py's (five workers, links paced in
process so the multicast takes seconds, no root), supervised as `layercast up` supervises it;
clients stream and not throughout. Asserted as for every fault: no request lost, a first success
within 5 s, the model listed throughout; and the pipeline failed, its requests handed over."""

import time

import httpx
import pytest

import pipeline_scenarios as scenario
from conftest import described, request_scale, running_cluster, wait_for
from fault_load import Load, assert_nothing_lost, measure, report_figures
from libs.cluster.launcher import kill_process
from libs.cluster.supervisor import Supervisor
from libs.planning.supervision import RestartBackoff
from libs.protocol import subjects

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres_server_url):
    checkpoint = scenario.four_blocks(tmp_path_factory)
    with running_cluster(postgres_server_url, checkpoint, scenario.DEPLOY,
                         state_dir=tmp_path_factory.mktemp("pipeline-faults"), api_key=scenario.API_KEY,
                         admin_key=scenario.ADMIN_KEY, workers=scenario.WORKERS, nats_url=None,
                         namespace=subjects.PREFIX,  # request_scale speaks this process's namespace
                         heartbeat_ttl_s=5.0,
                         extra_env={"LAYERCAST_SCALE_DOWN_DELAY": "600", "LAYERCAST_EMULATED_LINK_MBIT": "0.35"}) as state:
        with Supervisor(state, backoff=RestartBackoff(initial_s=0.2, max_s=2.0)) as supervisor:
            state.supervisor = supervisor
            yield state


def pipeline_serving(cluster):
    return next((i for i in described(cluster)["instances"] if i["mode"] == "pipeline" and i["state"] == "ready"),
                None)


def pipeline_tokens(cluster, workers: set[str]) -> float:
    """Tokens generated through pipelines on `workers` (their /metrics)."""
    total = 0.0
    for p in cluster.processes:
        if p.name in workers:
            for line in httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text.splitlines():
                if line.startswith("layercast_worker_generated_tokens_total{") and 'mode="pipeline"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def entry_loaded(cluster, worker: str) -> bool:
    """Whether `worker`'s own (local) instance holds every block: its multicast is over."""
    return any(i["mode"] == "local" and i["stages"][0]["worker_id"] == worker and i["loaded_at"] is not None
               for i in described(cluster)["instances"])


def test_a_pipeline_entry_stage_killed_mid_multicast_loses_no_request(cluster, request):
    scenario.warm(cluster)
    with Load(cluster.gateway_url, scenario.API_KEY, "tiny", clients=4, streaming=2) as load:
        request_scale(cluster.nats_url, scenario.WORKERS, reason="fault suite")
        pipeline = wait_for(lambda: pipeline_serving(cluster), 90, "a pipeline serving")
        entry = pipeline["stages"][0]["worker_id"]
        stages = {s["worker_id"] for s in pipeline["stages"]}
        wait_for(lambda: pipeline_tokens(cluster, stages) > 0 or entry_loaded(cluster, entry), 30,
                 "the pipeline generating")
        handovers = scenario.gateway_handovers(cluster)
        killed = {}

        def kill():
            # Still receiving: its own (local) instance has not every block yet.
            killed["mid_multicast"] = not entry_loaded(cluster, entry)
            since = time.monotonic()
            kill_process(cluster, entry)
            wait_for(lambda: any(e.kind == "restarted" and e.name == entry and e.at >= since
                                 for e in cluster.supervisor.events), 15, f"the supervisor to restart {entry}")
        figures = measure(load, "pipeline entry stage (mid-multicast)", kill, before_s=0.2,
                          recovery_timeout_s=90)
        figures["mid_multicast"] = killed["mid_multicast"]
        report_figures(request.config, [figures])
        wait_for(lambda: next((i for i in described(cluster)["instances"]
                               if i["instance_id"] == pipeline["instance_id"] and i["state"] != "ready"), None)
                 or pipeline["instance_id"] not in {i["instance_id"] for i in described(cluster)["instances"]},
                 30, "the pipeline failed")
    assert killed["mid_multicast"], "the entry stage had every block already: not a kill mid-multicast"
    assert_nothing_lost(figures, 5.0)
    assert scenario.gateway_handovers(cluster) > handovers  # its requests went on elsewhere
