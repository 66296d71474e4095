"""The worker's engine thread: an instance whose blocks are still arriving never stalls another."""

import asyncio
import time

from libs.checkpoint import CheckpointIndex, load_block
from libs.engine import Engine, SamplingParams
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
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS)
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
