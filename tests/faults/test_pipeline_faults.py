"""Fault injection during a scale-out (issue 40): the entry stage of an execution pipeline is
SIGKILLed while it still receives the model by multicast (a worker mid-multicast) and serves
through the pipeline. The cluster is tests/pipeline_scenarios.py's (five workers, links paced in
process so the multicast takes seconds, no root), supervised as `layercast up` supervises it;
clients stream and not throughout. Asserted as for every fault: no request lost, a first success
within 5 s, the model listed throughout; and the pipeline failed, its requests handed over."""

import os
import signal
import time

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
                         # one slot per instance (scenario.CLUSTER_ENV): a queued request reaches the
                         # pipeline as soon as it serves
                         extra_env=scenario.KILL_CLUSTER_ENV) as state:
        with Supervisor(state, backoff=RestartBackoff(initial_s=0.2, max_s=2.0)) as supervisor:
            state.supervisor = supervisor
            yield state


def test_a_pipeline_entry_stage_killed_mid_multicast_loses_no_request(cluster, request):
    scenario.warm(cluster)
    # Streaming clients only: the kill waits for a request mid-generation on the pipeline, as its
    # client sees it (its instance header, its tokens as they come); a non-streaming request's
    # tokens are seen at its end only, and the entry's count would never add up.
    with Load(cluster.gateway_url, scenario.API_KEY, "tiny", clients=4, streaming=4) as load:
        length = wait_for(lambda: next((r.tokens for r in load.streams() if r.ok), 0), 60,
                          "a streamed answer")  # every request's (greedy: the same tokens)
        # The pipeline and the workers' loads seen on NATS as they are announced (the admin API,
        # polled, answers seconds late on a loaded machine: the multicast could be over by the kill).
        with scenario.PipelineWatch(cluster.nats_url) as watch:
            request_scale(cluster.nats_url, scenario.WORKERS, reason="fault suite")
            assert watch.serving.wait(90), "a pipeline serving"
            pipeline = watch.instance
            entry, later = pipeline.stages[0].worker_id, pipeline.stages[1].worker_id
            later_pid = next(p for p in cluster.processes if p.name == later).pid
            handovers = scenario.gateway_handovers(cluster)
            killed = {}
            # Killed 0.5 s after the pipeline served, the entry often had no request: the
            # pipeline's (~0.1 s each on a fast machine, and only when every local instance is
            # busy) had ended. The later stage stopped, a request on the pipeline with tokens
            # to go cannot end: the entry dies with it in flight.
            stuck = scenario.stop_with_a_request_stuck(cluster, load.streams, pipeline, later_pid, length)

            def kill():
                try:
                    # Still receiving: its own (local) instance has not announced every block.
                    killed["mid_multicast"] = entry not in watch.loaded
                    since = time.monotonic()
                    kill_process(cluster, entry)
                finally:
                    os.kill(later_pid, signal.SIGCONT)  # only the entry is killed: the later stage goes on
                wait_for(lambda: any(e.kind == "restarted" and e.name == entry and e.at >= since
                                     for e in cluster.supervisor.events), 15, f"the supervisor to restart {entry}")
            try:
                figures = measure(load, "pipeline entry stage (mid-multicast)", kill, before_s=0,
                                  recovery_timeout_s=90)
            finally:
                os.kill(later_pid, signal.SIGCONT)  # (measure failed before the kill)
        figures["mid_multicast"] = killed["mid_multicast"]
        report_figures(request.config, [figures])
        wait_for(lambda: next((i for i in described(cluster)["instances"]
                               if i["instance_id"] == pipeline.instance_id and i["state"] != "ready"), None)
                 or pipeline.instance_id not in {i["instance_id"] for i in described(cluster)["instances"]},
                 30, "the pipeline failed")
    assert_nothing_lost(figures, 5.0)
    assert stuck.ok and stuck.tokens == length, (stuck.outcome, stuck.tokens)  # in flight at the kill, handed over
    assert scenario.gateway_handovers(cluster) > handovers  # its requests went on elsewhere
    if not killed["mid_multicast"]:
        # Stranding a request on the pipeline took so long (a busy machine) that the entry's copy
        # completed first (1 run in 4 here): the kill above was a pipeline entry's, checked as
        # such, but not one mid-multicast. Slower links did not help: at 0.2 Mbit/s no pipeline
        # served within 90 s (once; the planner's 15 s transfer stall timeout is the suspect).
        # Said, not passed silently.
        pytest.skip("the entry stage held every block before a request could be stranded on the pipeline: "
                    "a pipeline entry killed, not mid-multicast")
