"""The worker's memory orchestrator (services/worker/memory.py, LLM-Mesh §6.3): a scale-up waits
in the reservation station while a scale-down frees its part, is refused when the budget cannot
take it, a failed change is taken back (and refuses what waited on it), and the metrics say so."""

import asyncio

import pytest
from prometheus_client import REGISTRY

from services.worker.memory import MemoryOrchestrator, OutOfMemory


def metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_a_scale_up_waits_for_the_scale_down_that_makes_room():
    mem = MemoryOrchestrator(100)
    await mem.change("a", 70)
    freeing, free = asyncio.Event(), asyncio.Event()
    held: list[str] = []

    async def shrink():
        freeing.set()
        await free.wait()  # the memory is really freed only now
        held.append("a shrunk")

    waits = metric("layercast_worker_mesh_memory_waits_total")
    down = asyncio.ensure_future(mem.change("a", 20, shrink))
    await freeing.wait()
    assert mem.available == 80 and metric("layercast_worker_mesh_memory_budget_bytes") == 20  # optimistic
    up = asyncio.ensure_future(mem.change("b", 60, lambda: held.append("b grown")))
    await asyncio.sleep(0.01)
    assert not up.done() and held == []  # 70 + 60 would overrun: it waits
    assert metric("layercast_worker_mesh_memory_waits_total") == waits + 1
    assert metric("layercast_worker_mesh_memory_tracked_bytes") == 70
    free.set()
    await asyncio.gather(down, up)
    assert held == ["a shrunk", "b grown"]  # never both at their larger sizes
    assert mem.sizes == {"a": 20, "b": 60} and mem.state.tracked == mem.state.budget == 80
    assert metric("layercast_worker_mesh_memory_tracked_bytes") == 80


async def test_a_scale_up_the_budget_cannot_take_is_refused_and_changes_nothing():
    mem = MemoryOrchestrator(100)
    await mem.change("a", 70)
    refusals = metric("layercast_worker_mesh_memory_refusals_total")
    ran = []
    with pytest.raises(OutOfMemory):
        await mem.change("b", 40, lambda: ran.append(1))
    assert ran == [] and mem.sizes == {"a": 70} and mem.available == 30
    assert metric("layercast_worker_mesh_memory_refusals_total") == refusals + 1
    await mem.change("b", 30)  # what fits still does


async def test_a_failed_change_is_taken_back_and_refuses_what_waited_on_it():
    mem = MemoryOrchestrator(100)
    await mem.change("a", 90)
    started = asyncio.Event()

    async def failing_shrink():
        started.set()
        await asyncio.sleep(0.02)
        raise RuntimeError("resize failed")

    aborts = metric("layercast_worker_mesh_memory_aborts_total")
    down = asyncio.ensure_future(mem.change("a", 30, failing_shrink))
    await started.wait()
    up = asyncio.ensure_future(mem.change("b", 50))  # waits for the 60 bytes the shrink frees
    with pytest.raises(RuntimeError):
        await down
    with pytest.raises(OutOfMemory):  # they never came: refused, not stuck
        await up
    assert mem.sizes == {"a": 90} and mem.state.budget == mem.state.tracked == 90
    assert mem.state.running == mem.state.waiting == ()
    assert metric("layercast_worker_mesh_memory_aborts_total") == aborts + 1

    def failing_growth():
        raise ValueError("no")

    with pytest.raises(ValueError):
        await mem.change("c", 10, failing_growth)  # a sync change, failed: its bytes come back
    assert mem.size("c") == 0 and mem.available == 10


async def test_a_copying_resize_is_charged_old_plus_new_while_it_runs():
    mem = MemoryOrchestrator(100)
    await mem.change("kv", 40)
    seen = []
    await mem.change("kv", 30, lambda: seen.append(mem.state.tracked), during=70)
    assert seen == [70] and mem.sizes == {"kv": 30} and mem.state.tracked == 30
    await mem.change("other", 50)
    with pytest.raises(OutOfMemory):  # 30 + 40 held at once, with 50 elsewhere: 120
        await mem.change("kv", 40, during=70)
    assert mem.sizes == {"kv": 30, "other": 50}


async def test_a_cancelled_wait_gives_its_budget_back_and_releases_forget():
    mem = MemoryOrchestrator(100)
    await mem.change("a", 80)
    gate = asyncio.Event()
    down = asyncio.ensure_future(mem.change("a", 10, gate.wait))
    await asyncio.sleep(0)
    up = asyncio.ensure_future(mem.change("b", 50))
    await asyncio.sleep(0.01)
    assert mem.state.waiting and mem.available == 40
    up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await up
    assert mem.state.waiting == () and mem.available == 90
    gate.set()
    await down
    await mem.release("a")
    assert mem.sizes == {} and mem.state.budget == mem.state.tracked == 0
    # an engine-thread call returns a future: awaited like a coroutine
    assert await mem.change("c", 5, lambda: asyncio.get_running_loop().run_in_executor(None, lambda: 7)) == 7


def test_a_cuda_workers_default_capacity_leaves_the_forward_pass_its_working_memory(monkeypatch):
    # No GPU here: torch.cuda.mem_get_info stands in for the device (the GPU check runs the real one,
    # tests/gpu/test_worker_gpu.py). The GPU run found cuBLAS's 32 MiB workspace charged to nobody.
    import torch

    from services.worker.service import WorkerConfig, memory_capacity

    free = 80 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 81 << 30))
    assert memory_capacity(WorkerConfig(worker_id="w", device="cuda")) == free - (1 << 30)
    assert memory_capacity(WorkerConfig(worker_id="w", device="cuda", device_working_bytes=0)) == free
    assert memory_capacity(WorkerConfig(worker_id="w", device="cuda", device_working_bytes=2 * free)) == 0
    assert memory_capacity(WorkerConfig(worker_id="w", device="cuda", memory_capacity_bytes=5)) == 5
