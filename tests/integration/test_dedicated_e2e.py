"""sharing=dedicated end to end: one worker process, two models. While the worker serves
model `a`, a request for model `b` (no instance anywhere) is still served: the planner takes the
worker for b's first instance (pick_dedicated_targets), the worker unloads a (its stream in
flight ends first) and only then loads b. Real processes: NATS, Postgres, registry, planner,
load-monitor, one worker, gateway; the official `openai` client. Asserted from the instance
events the worker published (their order on one NATS connection) and its unload counter: the
worker never held two models at once, and both requests got every token."""

import threading
import uuid

import httpx
import openai
import pytest

from benchmarks.bench_trace import make_bench_model, model_limits, prompt_ids
from benchmarks.harness import EventRecorder
from libs.admin import deploy_model
from libs.checkpoint import convert_checkpoint, create_demo_checkpoint
from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes
from conftest import TEST_ADMIN_KEY, TEST_API_KEY, fresh_database, wait_for

pytestmark = pytest.mark.slow

A_TOKENS, B_TOKENS = 200, 20


def _bench_checkpoint(root, seed: int):
    """A tiny demo model without an end token (every request runs to its max_tokens)."""
    hf = create_demo_checkpoint(root / "hf", preset="tiny", arch="llama", seed=seed)
    make_bench_model(hf)
    convert_checkpoint(hf, root / "blocks", 2)
    return root / "blocks"


def held_intervals(events, worker: str) -> list[tuple[int, int, str]]:
    """(first, last event index, model) of each instance that got an engine on `worker`: from its
    ready event to its stopped/failed one (or the end)."""
    opened: dict[str, tuple[int, str]] = {}
    closed: set[str] = set()
    out = []
    for k, ev in enumerate(events):
        if worker not in ev.workers or ev.instance_id in closed:
            continue
        if ev.state == "ready" and ev.instance_id not in opened:
            opened[ev.instance_id] = (k, ev.model)
        elif ev.state in ("stopped", "failed") and ev.instance_id in opened:
            start, model = opened.pop(ev.instance_id)
            closed.add(ev.instance_id)
            out.append((start, k, model))
    out += [(start, len(events), model) for start, model in opened.values()]
    return out


def test_a_dedicated_worker_unloads_one_model_before_it_serves_another(tmp_path_factory, postgres_server_url,
                                                                       nats_url):
    root = tmp_path_factory.mktemp("dedicated")
    models = {"a": _bench_checkpoint(root / "a", 0), "b": _bench_checkpoint(root / "b", 1)}
    namespace = f"dedicated-{uuid.uuid4().hex[:6]}"
    with fresh_database(postgres_server_url) as db:
        state = start_cluster(ClusterSpec(
            state_dir=root / "cluster", port=free_port(), database_url=db, api_key=TEST_API_KEY,
            admin_key=TEST_ADMIN_KEY, workers=1, nats_url=nats_url, namespace=namespace, heartbeat_ttl_s=2.0,
            extra_env={"LAYERCAST_SHARING": "dedicated"}))
        try:
            with EventRecorder(nats_url, namespace) as recorder:
                deploy_model(state, "a", models["a"], min_instances=1, max_instances=1, keep_alive_s=600)
                deploy_model(state, "b", models["b"], min_instances=0, max_instances=1, keep_alive_s=600)
                client = openai.OpenAI(base_url=state.gateway_url + "/v1", api_key=state.api_key, timeout=60)
                wait_for(lambda: client.completions.create(model="a", prompt=[5, 6, 7], max_tokens=1), 30,
                         "a to serve")
                vocab, _, eos = model_limits(models["a"])
                a_tokens: list[str] = []
                first = threading.Event()

                def stream_a() -> None:
                    for chunk in client.completions.create(model="a", prompt=prompt_ids(8, 1, vocab, eos),
                                                           max_tokens=A_TOKENS, temperature=0, stream=True):
                        if chunk.choices:
                            a_tokens.append(chunk.choices[0].text)
                            first.set()

                reader = threading.Thread(target=stream_a)
                reader.start()
                assert first.wait(30), "a's stream sent no token"
                # The worker serves a: b has no instance anywhere, so b's request waits at the
                # gateway while the worker switches models.
                b = client.completions.create(model="b", prompt=prompt_ids(8, 2, vocab, eos), max_tokens=B_TOKENS,
                                              temperature=0)
                reader.join(60)
                assert not reader.is_alive()
                events = recorder.instance_records()
        finally:
            worker = next(p for p in state.processes if p.name.startswith("worker"))
            metrics = httpx.get(worker.health_url.replace("/health", "/metrics"), timeout=10).text
            stop_processes(state.processes)

    assert b.choices[0].finish_reason == "length" and b.usage.completion_tokens == B_TOKENS
    assert len(a_tokens) == A_TOKENS  # a's request in flight was not lost to the unload
    worker_id = next(w for ev in events for w in ev.workers)
    held = held_intervals(events, worker_id)
    assert {model for _, _, model in held} == {"a", "b"}, events
    # a was unloaded for b: its instance stopped before b's got an engine, and never two overlap
    for i, (s1, e1, m1) in enumerate(held):
        for s2, e2, m2 in held[i + 1:]:
            assert m1 == m2 or e1 < s2 or e2 < s1, (held, events)
    unloaded = [ev for ev in events if ev.state == "stopped" and "sharing=dedicated" in ev.reason]
    assert unloaded and unloaded[0].model == "a", events
    assert "layercast_worker_dedicated_unloads_total 1.0" in metrics or any(
        line.startswith("layercast_worker_dedicated_unloads_total ") and float(line.split()[1]) >= 1
        for line in metrics.splitlines())
