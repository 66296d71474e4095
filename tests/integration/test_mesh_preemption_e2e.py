"""LLM-Mesh's proactive defragmentation (§7.1) on real worker processes: two workers in mesh
mode, model `big` on one of them, model `small` on both. On the shared worker, a `big` request
that fails shadow validation only because `small`'s request is there preempts it (a smaller
batch, with room to meet its SLO elsewhere): the `big` request is admitted and `small`'s
request ends there with a `preempted` event, for the gateway to hand it over (tested in
tests/unit/gateway/test_mesh_routing.py). With preemption off, the same request is refused
("busy").

The test sends generate RPCs to chosen instances itself and reads their token streams, through
the gateway's `NatsWorkerClient`, so that it picks the SLOs that make exactly the third case of
Fig. 6 (the node's decode iteration against the TPOT SLO) fail with `small` there and pass
without it, from the profiles the workers stored in the registry.
"""

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import httpx
import openai
import pytest

from libs.admin import deploy_model
from libs.bus.broker import RemoteError, call, make_broker, start_broker
from libs.checkpoint import convert_checkpoint, create_demo_checkpoint
from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes
from libs.planning.mesh import MARGIN
from libs.planning.mesh_profiles import profile_from_message
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import NatsWorkerClient
from conftest import fresh_database, wait_for

pytestmark = pytest.mark.slow

GATEWAY_ID = "test-preemption"
PROMPT = [1, 17, 200, 45, 9, 33, 71, 5]
LONG = 400  # tokens: every request still runs when the last one arrives
LOOSE = dict(ttft_slo_s=60.0, tpot_slo_s=10.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preemption-models")
    out = {}
    # `small` (its batch is) is the larger checkpoint: its decode iteration stands out of the
    # profiles' noise, so a TPOT SLO between the two cases exists.
    for name, preset, seed in (("big", "tiny", 0), ("small", "small", 1)):
        hf = create_demo_checkpoint(root / name / "hf", preset=preset, arch="llama", seed=seed)
        convert_checkpoint(hf, root / name / "blocks", 2)
        out[name] = root / name / "blocks"
    return out


def _admitted(worker, model: str) -> float:
    text = httpx.get(worker.health_url.replace("/health", "/metrics"), timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("layercast_worker_mesh_admissions_total{") and f'model="{model}"' in line
               and 'verdict="admitted"' in line)


async def _scenario(state, nats_url: str) -> dict:
    broker = make_broker(nats_url)
    workers = NatsWorkerClient(broker, GATEWAY_ID)  # as the gateway sends requests, this test picking the SLOs
    events: dict[str, list[m.TokenEvent]] = defaultdict(list)
    workers.listen(lambda ev: events[ev.request_id].append(ev))

    async def generate(inst: m.InstanceInfo, request_id: str, max_tokens: int, **fields) -> None:
        req = m.GenerateRequest(request_id=request_id, instance_id=inst.instance_id, model=inst.model,
                                prompt_ids=PROMPT, sampling=m.SamplingSpec(max_tokens=max_tokens, temperature=0),
                                reply_subject=workers.reply_subject(request_id), **fields)
        await workers.generate(inst.entry_worker, req, timeout_s=10)

    async def tokens(request_id: str, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sum(e.token_id is not None for e in events.get(request_id, [])) < n:
            assert time.monotonic() < deadline, f"{request_id}: fewer than {n} tokens"
            await asyncio.sleep(0.01)

    await start_broker(broker)
    try:
        view = await call(broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0), m.ClusterView)
        ready = [i for i in view.instances if i.state == m.InstanceState.ready]
        [big] = [i for i in ready if i.model == "big"]
        [small] = [i for i in ready if i.model == "small" and i.entry_worker == big.entry_worker]
        worker = next(p for p in state.processes if p.name == big.entry_worker)
        # The shared worker validates both models (it has their profiles), and knows `small` is
        # served elsewhere too (its view refreshes every 2 s).
        for k in range(200):
            if all(_admitted(worker, x.model) > 0 for x in (big, small)):
                break
            for x in (big, small):
                await generate(x, f"probe-{x.model}-{k}", 1, **LOOSE)
            await asyncio.sleep(0.25)
        assert all(_admitted(worker, x.model) > 0 for x in (big, small)), "no validated admission on the shared worker"
        await asyncio.sleep(4.0)

        # Fig. 6 case 1 on the idle node: a TTFT SLO no prefill meets is refused, unless the
        # request has already waited past it at the gateway (then only case 2 or 3 could refuse).
        impossible = dict(ttft_slo_s=1e-4, tpot_slo_s=10.0)
        try:
            await generate(big, "fresh-late", 1, **impossible)
            fresh = "admitted"
        except RemoteError as e:
            fresh = e.code
        await generate(big, "overdue", 1, queued_s=1.0, **impossible)
        await tokens("overdue", 1)

        profiles = {}
        for name in ("big", "small"):
            stored = await call(broker, subjects.REGISTRY_PROFILE_GET, m.ProfileRef(model=name, device="cpu"),
                                m.ModelProfile)
            profiles[name] = profile_from_message(stored)
        lengths = [len(PROMPT) + g for g in (1, 8, 16, 32, 64)]  # the requests' lengths when the last one comes
        big3 = [profiles["big"].decode_time(3, n) for n in lengths]
        small1 = [profiles["small"].decode_time(1, n) for n in lengths]
        # A TPOT SLO that big's batch of three meets alone but not beside small's request.
        low, high = (1 + MARGIN) * max(big3), (1 + MARGIN) * (min(big3) + min(small1))
        if low >= high:
            # The scenario needs profiles whose decode times grow with the batch; a worker profiled
            # while other test files load both cores measured noise (e.g. 22 ms at the shortest
            # length, 7.5 ms at the longest). Not the behaviour under test: said, not failed.
            pytest.skip(f"the measured profiles separate no TPOT SLO (a loaded machine): {low:.5f} s >= "
                        f"{high:.5f} s ({big3}, {small1})")
        tpot = (low + high) / 2

        await generate(small, "small-1", LONG, **LOOSE)
        await generate(big, "big-1", LONG, **LOOSE)
        await generate(big, "big-2", LONG, **LOOSE)
        for rid in ("small-1", "big-1", "big-2"):
            await tokens(rid, 2)  # decoding: the node's decode iteration holds all three
        try:
            await generate(big, "big-3", LONG, ttft_slo_s=60.0, tpot_slo_s=tpot)
            outcome = "admitted"
        except RemoteError as e:
            outcome = e.code
        if outcome == "admitted":
            await tokens("big-3", 1)
        await asyncio.sleep(0.5)
        small_events = list(events.get("small-1", []))
        for inst, rid in ((small, "small-1"), (big, "big-1"), (big, "big-2"), (big, "big-3")):
            await workers.cancel(inst.entry_worker, m.CancelRequest(request_id=rid, instance_id=inst.instance_id))
        return {"outcome": outcome, "small": small_events, "tpot": tpot, "fresh": fresh}
    finally:
        await broker.stop()


@pytest.mark.parametrize("preemption", [True, False], ids=["preemption", "no-preemption"])
def test_a_larger_instance_preempts_a_smaller_neighbour_that_can_go_on_elsewhere(
        preemption, tmp_path_factory, postgres_server_url, nats_url, checkpoints):
    with fresh_database(postgres_server_url) as db:
        state = start_cluster(ClusterSpec(
            state_dir=tmp_path_factory.mktemp("preemption-cluster"), port=free_port(), database_url=db, workers=2,
            nats_url=nats_url, namespace=subjects.PREFIX, heartbeat_ttl_s=3.0,
            extra_env={"LAYERCAST_SHARING": "mesh", "LAYERCAST_PROFILE_MAX_LEN": "64",
                       "LAYERCAST_PREEMPTION": "1" if preemption else "0"}))
        try:
            deploy_model(state, "big", checkpoints["big"], min_instances=1, max_instances=1, keep_alive_s=600)
            deploy_model(state, "small", checkpoints["small"], min_instances=2, max_instances=2, keep_alive_s=600)
            client = openai.OpenAI(base_url=state.gateway_url + "/v1", api_key=state.api_key, timeout=60)
            for name in ("big", "small"):
                wait_for(lambda: client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=1), 120,
                         f"{name} to serve")
            wait_for(lambda: sum(i["state"] == "ready" for i in httpx.get(
                f"{state.gateway_url}/admin/v1/models/small", timeout=10,
                headers={"Authorization": f"Bearer {state.admin_key}"}).json()["instances"]) == 2, 120,
                "two instances of small")
            got = asyncio.run(_scenario(state, nats_url))
        finally:
            stop_processes(state.processes)
    small = got["small"]
    assert got["fresh"] == "busy", got  # the overdue one was admitted (it raised otherwise)
    if preemption:
        assert got["outcome"] == "admitted", got
        [moved] = [e for e in small if e.error is not None]
        assert moved.preempted and moved.finished and "preempted" in moved.error
        assert moved.index == sum(e.token_id is not None for e in small)  # every token it had sent, then moved
    else:
        assert got["outcome"] == "busy", got
        assert all(e.error is None for e in small)
