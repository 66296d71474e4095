"""LLM-Mesh hazard-aware memory end to end (sharing=mesh, §6): two models share one worker whose
memory cap holds both models' weights but only a few KV slots, far fewer than a burst across
both needs (and than their fixed KV caches would take). The burst completes, every request
served, while what the worker's engines hold (measured from them, a resize's two pools
together) never passes the cap: KV caches grow and shrink with the requests, a request whose KV
cannot be granted is answered "busy" and the gateway waits, nothing runs out of memory.

Real processes: NATS, Postgres, registry, planner, load-monitor, one worker, gateway; the
official `openai` client."""

import concurrent.futures
from pathlib import Path

import httpx
import openai
import pytest

from libs.admin import deploy_model
from libs.checkpoint import CheckpointIndex
from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes
from libs.engine import kv_slot_bytes_of
from libs.protocol import subjects
from conftest import fresh_database, wait_for
from conftest_models import two_tiny_llamas

pytestmark = pytest.mark.slow

MAX_SEQ_LEN = 2048  # the worker's default: one KV slot holds this many tokens
KV_SLOTS = 6  # what the cap leaves for KV, both models together
BURST, PROMPT, TOKENS = 12, 20, 24  # per model, at once


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return two_tiny_llamas(tmp_path_factory.mktemp("mesh-memory-models"))


def _metrics(state) -> dict[str, float]:
    [worker] = [p for p in state.processes if p.name.startswith("worker")]
    text = httpx.get(worker.health_url.replace("/health", "/metrics"), timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("layercast_worker_mesh_"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + ("{" + name.split("{", 1)[1] if 'direction="' in name else "")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _resizes(metrics: dict[str, float], direction: str) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith("layercast_worker_mesh_kv_resizes_total") and f'direction="{direction}"' in k)


def test_a_burst_across_two_models_fits_a_memory_cap_it_would_exceed_without_orchestration(
        tmp_path_factory, postgres_server_url, nats_url, checkpoints):
    indexes = {name: CheckpointIndex.load(path) for name, path in checkpoints.items()}
    slot = max(kv_slot_bytes_of(i, MAX_SEQ_LEN) for i in indexes.values())
    weights = sum(i.total_nbytes for i in indexes.values())
    cap = weights + KV_SLOTS * slot
    # Without the orchestration: fixed KV (16 slots a model), or KV grown to the burst (12 each).
    assert 2 * BURST * slot > cap - weights
    with fresh_database(postgres_server_url) as db:
        state = start_cluster(ClusterSpec(
            state_dir=tmp_path_factory.mktemp("mesh-memory-cluster"), port=free_port(), database_url=db,
            workers=1, nats_url=nats_url, namespace=subjects.PREFIX, heartbeat_ttl_s=2.0,
            extra_env={"LAYERCAST_SHARING": "mesh", "LAYERCAST_SHADOW_VALIDATION": "0",
                       "LAYERCAST_PROFILE_MAX_LEN": "16", "LAYERCAST_MEMORY_CAPACITY_BYTES": str(cap),
                       "LAYERCAST_KV_WATERMARK": "0.2", "LAYERCAST_KV_MIN_SLOTS": "1"}))
        try:
            for name, path in checkpoints.items():
                deploy_model(state, name, path, min_instances=1, max_instances=1, keep_alive_s=600)
            client = openai.OpenAI(base_url=state.gateway_url + "/v1", api_key=state.api_key, timeout=300)
            for name in checkpoints:
                wait_for(lambda: client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=1), 120,
                         f"{name} to serve")
            before = _metrics(state)

            def one(name: str, k: int) -> tuple[str, int]:
                prompt = [(7 + 13 * i + 101 * k) % 500 + 1 for i in range(PROMPT)]
                r = client.completions.create(model=name, prompt=prompt, max_tokens=TOKENS, temperature=0)
                return r.choices[0].finish_reason, r.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(2 * BURST) as pool:
                futures = [pool.submit(one, name, k) for k in range(BURST) for name in checkpoints]
                ends = [f.result(timeout=600) for f in futures]
            # Lazy scale-down once the burst is over: each cache back near its L_min.
            wait_for(lambda: _resizes(_metrics(state), "down") > _resizes(before, "down") or None, 30,
                     "a KV cache to shrink")
            after = _metrics(state)
        finally:
            stop_processes(state.processes)
    assert len(ends) == 2 * BURST and all(e in ("length", "stop") and n > 0 for e, n in ends), ends  # none lost
    held = after["layercast_worker_mesh_memory_held_peak_bytes"]
    assert held <= cap, f"the engines held {held} bytes at once, over the cap of {cap}"  # no OOM
    assert after["layercast_worker_mesh_memory_tracked_bytes"] <= cap
    assert after["layercast_worker_mesh_memory_capacity_bytes"] == cap
    assert _resizes(after, "up") > _resizes(before, "up")  # the KV grew with the burst ...
    assert _resizes(after, "down") > _resizes(before, "down")  # ... and shrank after it
    # The cap did bind: some KV growth was refused (answered busy; the gateway waited) or waited.
    assert (after["layercast_worker_mesh_memory_refusals_total"] + after["layercast_worker_mesh_memory_waits_total"]
            > before.get("layercast_worker_mesh_memory_refusals_total", 0)
            + before.get("layercast_worker_mesh_memory_waits_total", 0))
