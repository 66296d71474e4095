"""The worker's engine thread: an instance whose blocks are still arriving never stalls another."""

import asyncio
import time

from libs.checkpoint import CheckpointIndex, load_block
from libs.engine import Engine, SamplingSpec
from services.worker.loading import _BlockFutures
from services.worker.runtime import EngineRuntime

TOKENS = 12


def test_a_request_waiting_for_a_block_does_not_delay_another_instances_tokens(tiny_checkpoint):
    index = CheckpointIndex.load(tiny_checkpoint)
    blocks = {b.id: load_block(tiny_checkpoint, index, b.id) for b in index.blocks}
    warm = Engine(index, blocks, max_batch_size=2, max_seq_len=64)
    arriving = _BlockFutures(list(blocks))
    arriving.set(0, blocks[0])  # the last block is still on its way
    loading = Engine(index, arriving, max_batch_size=2, max_seq_len=64)
    greedy = SamplingSpec(temperature=0, max_tokens=TOKENS)
    late_s = 2.0

    async def run() -> dict[str, list[float]]:
        seen: dict[str, list[float]] = {"warm": [], "loading": []}
        done = asyncio.Event()

        def sink(batch):
            for _, rid, out, error in batch:
                assert error is None, error
                seen[rid].append(time.monotonic())
                if len(seen["warm"]) == len(seen["loading"]) == TOKENS:
                    done.set()

        runtime = EngineRuntime(asyncio.get_running_loop(), sink)
        runtime.start()
        try:
            runtime.attach("i-loading", loading)
            runtime.attach("i-warm", warm)
            runtime.submit("i-loading", "loading", [1, 2, 3], greedy)
            await asyncio.sleep(0.1)  # the loading instance's request is in first
            started = time.monotonic()
            runtime.submit("i-warm", "warm", [4, 5, 6], greedy)
            await asyncio.sleep(late_s)
            arriving.set(1, blocks[1])
            runtime.wake()
            await asyncio.wait_for(done.wait(), 30)
        finally:
            runtime.stop()
        seen["started"] = [started]
        return seen

    seen = asyncio.run(run())
    # Every token of the warm instance came while the other waited for its block ...
    assert seen["warm"][-1] - seen["started"][0] < late_s / 2
    # ... and the waiting request went on once the block was in.
    assert seen["loading"][0] - seen["started"][0] >= late_s * 0.9


def _run_two(tiny_checkpoint, schedule: str) -> tuple[list[str], list | None]:
    """Two instances, one request each: `urgent` due at once (tight SLOs), `relaxed` in 100 s.
    The order their tokens come in, and the steps the runtime timed."""
    index = CheckpointIndex.load(tiny_checkpoint)
    blocks = {b.id: load_block(tiny_checkpoint, index, b.id) for b in index.blocks}
    greedy = SamplingSpec(temperature=0, max_tokens=TOKENS)

    async def run() -> tuple[list[str], list | None]:
        order: list[str] = []
        done = asyncio.Event()

        def sink(batch):
            for _, rid, out, error in batch:
                assert error is None, error
                order.append(rid)
                if len(order) == 2 * TOKENS:
                    done.set()

        runtime = EngineRuntime(asyncio.get_running_loop(), sink, schedule=schedule)
        runtime.start()
        try:
            for name in ("relaxed", "urgent"):
                runtime.attach(f"i-{name}", Engine(index, blocks, max_batch_size=2, max_seq_len=64))
            # Both in before the engine thread steps either (it drains its inbox first).
            runtime.call(lambda: time.sleep(0.2))
            now = time.monotonic()
            runtime.submit("i-relaxed", "relaxed", [4, 5, 6], greedy, slo=(now, 100.0, 1.0))
            runtime.submit("i-urgent", "urgent", [1, 2, 3], greedy, slo=(now, 0.01, 0.01))
            await asyncio.wait_for(done.wait(), 30)
        finally:
            runtime.stop()
        return order, None if runtime.step_times is None else list(runtime.step_times)

    return asyncio.run(run())


def test_the_headroom_schedule_runs_the_instance_holding_the_most_urgent_request(tiny_checkpoint):
    # LLM-Mesh §5.1: the urgent request's instance keeps the engine thread while its headroom
    # stays the least: every one of its tokens before the relaxed one's first.
    order, _ = _run_two(tiny_checkpoint, "headroom")
    assert order == ["urgent"] * TOKENS + ["relaxed"] * TOKENS


def test_the_turns_schedule_steps_every_instance_in_turn(tiny_checkpoint):
    order, timed = _run_two(tiny_checkpoint, "turns")
    assert order.index("relaxed") < order.index("urgent") + 2  # interleaved from the start
    assert timed is None  # no profiles to refresh


def test_the_headroom_schedule_times_each_step_with_what_it_computed(tiny_checkpoint):
    """Live profile refresh reads these: the urgent instance's first step prefilled its prompt
    alone, every later one decoded its one row, one token longer each time."""
    _, timed = _run_two(tiny_checkpoint, "headroom")
    urgent = [(shape, seconds) for inst, shape, seconds in timed if inst == "i-urgent"]
    assert len(urgent) == TOKENS and all(seconds > 0 for _, seconds in urgent)
    first = urgent[0][0]
    assert (first.decode_rows, first.prefill_tokens, first.prefill_rows) == (0, 3, 1)
    for k, (shape, _) in enumerate(urgent[1:]):
        assert (shape.decode_rows, shape.decode_mean_len, shape.prefill_tokens) == (1, 4 + k, 0)


def test_calls_run_on_the_engine_thread(tiny_checkpoint):
    import threading

    async def run() -> str:
        runtime = EngineRuntime(asyncio.get_running_loop(), lambda batch: None)
        runtime.start()
        try:
            return await asyncio.wait_for(runtime.call(lambda: threading.current_thread().name), 10)
        finally:
            runtime.stop()

    assert asyncio.run(run()) == "engine"
