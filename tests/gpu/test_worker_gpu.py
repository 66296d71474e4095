"""The worker on the target device, in this process against real NATS and a registry (SQLite):
its memory report (torch.cuda.mem_get_info on CUDA), the mesh memory orchestration under a cap
while two models take a burst (on CUDA: torch.cuda.max_memory_allocated never passes the cap plus the engine
thread's cuBLAS workspace),
and a CPU worker beside a device worker serving the same model with equal greedy tokens
(LLM-Mesh's heterogeneous case)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from libs.bus.broker import RemoteError, call
from libs.checkpoint import CheckpointIndex
from libs.engine import kv_slot_bytes_of
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway.workers import NatsWorkerClient
from services.worker.service import WorkerConfig, WorkerService, memory_capacity

sys.path.append(str(Path(__file__).parents[1] / "integration"))
from test_registry import client, collect, started  # noqa: E402,F401  (client: a fixture)
from conftest_models import two_tiny_llamas  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_SEQ_LEN = 2048  # the worker's default: one KV slot holds this many tokens
KV_SLOTS = 6  # what the cap leaves for KV, both models together
BURST, PROMPT_LEN, TOKENS = 12, 20, 24  # per model, at once


def test_the_worker_reports_the_devices_free_memory(device):
    config = WorkerConfig(worker_id="w-mem", device=str(device))
    reported = memory_capacity(config)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        assert 0 < reported <= total
        # the same figure less the working memory left for the forward pass, give or take an allocation
        assert abs(reported - (free - config.device_working_bytes)) <= 64 << 20, (reported, free)
    else:
        assert abs(reported - psutil.virtual_memory().available) <= 0.1 * psutil.virtual_memory().total
    assert memory_capacity(WorkerConfig(worker_id="w-cap", device=str(device), memory_capacity_bytes=123)) == 123


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> dict[str, Path]:
    return two_tiny_llamas(tmp_path_factory.mktemp("gpu-mesh-models"))


async def _load(client, worker_id: str, instance_id: str, model: str, path: Path, seen: list) -> None:  # noqa: F811
    index = CheckpointIndex.load(path)
    load = m.LoadModel(instance_id=instance_id, model=model, path=str(path), block_start=0, block_end=index.n_blocks)
    assert (await call(client, subjects.worker_command(worker_id), load, m.CommandAck)).accepted
    for _ in range(1200):
        states = [ev.instance.state for ev in seen if ev.instance.instance_id == instance_id]
        if m.InstanceState.failed in states:
            raise AssertionError(f"{instance_id} failed to load")
        if any(ev.instance.instance_id == instance_id and ev.instance.loaded_at for ev in seen):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{instance_id} not loaded after 60 s")


async def _generate(client, worker_id: str, instance_id: str, model: str, prompt: list[int],  # noqa: F811
                    tokens: int) -> list[int]:
    """Greedy tokens of one request sent straight to the worker through the gateway's
    `NatsWorkerClient`; a "busy" answer is asked again, as the gateway does."""
    workers = NatsWorkerClient(client, gateway_id="gpu-test")
    request_id = f"g-{uuid.uuid4().hex[:8]}"
    reply = workers.reply_subject(request_id)
    events: list[m.TokenEvent] = []
    done = asyncio.Event()
    sub = client.subscriber(reply)  # this request's tokens only (`listen` takes every request's, before start)

    @sub
    async def on_token(body: dict) -> None:
        ev = m.TokenEvent.model_validate(body)
        events.append(ev)
        if ev.finished or ev.error:
            done.set()

    await sub.start()
    try:
        req = m.GenerateRequest(request_id=request_id, instance_id=instance_id, model=model, prompt_ids=prompt,
                                reply_subject=reply, sampling=m.SamplingSpec(temperature=0, max_tokens=tokens))
        for _ in range(3000):
            try:
                await workers.generate(worker_id, req, timeout_s=10.0)
                break
            except RemoteError as e:
                if e.code != "busy":
                    raise
                await asyncio.sleep(0.02)  # as the gateway does: wait for room and ask again
        else:
            raise AssertionError(f"{request_id} refused busy for a minute")
        await asyncio.wait_for(done.wait(), 120)
    finally:
        await sub.stop()
    assert not any(ev.error for ev in events), [ev.error for ev in events if ev.error]
    return [ev.token_id for ev in sorted(events, key=lambda e: e.index) if ev.token_id is not None]


def _cublas_workspace_bytes(device: torch.device) -> int:
    """What a thread's first matrix product allocates beside its result: cuBLAS's workspace (torch
    keeps one per handle and stream; 32 MiB on Hopper). The engine thread's is device working
    memory the mesh does not charge (WorkerConfig.device_working_bytes leaves room for it)."""
    def probe() -> int:
        a = torch.ones(64, 64, device=device)
        with torch.cuda.stream(torch.cuda.Stream(device)):  # a new stream: a workspace of its own
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            b = a @ a
            torch.cuda.synchronize(device)
            return torch.cuda.memory_allocated(device) - before - b.nbytes

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(probe).result()


def _prompt(k: int) -> list[int]:
    return [(7 + 13 * i + 101 * k) % 500 + 5 for i in range(PROMPT_LEN)]


async def test_two_models_take_a_burst_within_the_memory_cap(tmp_path, device, nats_url, client,  # noqa: F811
                                                             two_models):
    indexes = {name: CheckpointIndex.load(path) for name, path in two_models.items()}
    slot = max(kv_slot_bytes_of(i, MAX_SEQ_LEN) for i in indexes.values())
    weights = sum(i.total_nbytes for i in indexes.values())
    cap = weights + KV_SLOTS * slot
    assert 2 * BURST * slot > cap - weights  # the burst's KV does not fit: the cap binds
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    reg = await started(f"sqlite:///{tmp_path / 'registry.db'}", nats_url)
    worker = WorkerService(WorkerConfig(
        worker_id="w-mesh", device=str(device), sharing="mesh", shadow_validation=False, profile_max_len=16,
        memory_capacity_bytes=cap, kv_watermark=0.2, kv_min_slots=1, max_seq_len=MAX_SEQ_LEN), nats_url)
    await worker.start()
    try:
        for name, path in two_models.items():
            await _load(client, "w-mesh", f"i-{name}", name, path, seen)
        burst = [_generate(client, "w-mesh", f"i-{name}", name, _prompt(k), TOKENS)
                 for k in range(BURST) for name in two_models]
        outs = await asyncio.gather(*burst)
        assert len(outs) == 2 * BURST and all(len(o) > 0 for o in outs)  # every request served
        held_peak = worker.sharing.node.held_peak  # mesh: the engines' memory as charged
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - baseline
    finally:
        await sub.stop()
        await worker.stop()
        await reg.stop()
    assert 0 < held_peak <= cap, f"the engines held {held_peak} bytes at once, over the cap of {cap}"
    assert held_peak > weights  # the KV did grow with the burst
    if cuda:  # the device's own count: what the mesh charged, plus the engine thread's cuBLAS workspace
        workspace = _cublas_workspace_bytes(device)
        print(f"cap {cap}, charged peak {held_peak}, device peak {peak}, cuBLAS workspace {workspace} (bytes)")
        assert peak <= cap + workspace, (f"torch.cuda.max_memory_allocated() rose {peak} bytes, over the cap of "
                                         f"{cap} plus a cuBLAS workspace of {workspace}")


async def test_a_cpu_worker_and_a_device_worker_serve_the_same_model_with_equal_tokens(
        tmp_path, device, nats_url, client, two_models):  # noqa: F811
    path = two_models["alpha"]
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    reg = await started(f"sqlite:///{tmp_path / 'registry.db'}", nats_url)
    workers = {wid: WorkerService(WorkerConfig(worker_id=wid, device=dev, kv_cache_bytes=64 << 20), nats_url)
               for wid, dev in (("w-cpu", "cpu"), ("w-dev", str(device)))}
    for w in workers.values():
        await w.start()
    try:
        await asyncio.gather(*(_load(client, wid, f"i-{wid}", "alpha", path, seen) for wid in workers))
        assert torch.device(workers["w-dev"].config.device).type == device.type
        prompts = [_prompt(k) for k in range(4)]
        # Both workers at once, the same prompts: the heterogeneous mesh's two kinds of instance.
        runs = await asyncio.gather(*(_generate(client, wid, f"i-{wid}", "alpha", p, TOKENS)
                                      for wid in workers for p in prompts))
    finally:
        await sub.stop()
        for w in workers.values():
            await w.stop()
        await reg.stop()
    on_cpu, on_device = runs[:len(prompts)], runs[len(prompts):]
    assert all(len(r) > 0 for r in runs)
    assert on_cpu == on_device
