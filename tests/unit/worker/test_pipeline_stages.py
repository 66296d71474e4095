"""A worker's pipeline stages (services/worker/pipelines.py) over fake ports: what a
StartPipeline is checked against before any engine is built, with no WorkerService."""

from types import SimpleNamespace

import pytest

from libs.bus.broker import DomainError
from libs.protocol import messages as m
from services.worker.pipelines import PipelineStages

CONFIG = SimpleNamespace(worker_id="w2", device="cpu", max_batch_size=4, max_seq_len=64, kv_cache_bytes=1 << 20)


def _stages(blocks_here: dict[int, object], instances: dict | None = None):
    checked: list[str] = []

    def unusable(name: str):
        def fail():
            raise AssertionError(f"the {name} is not needed before the checks pass")
        return fail

    stages = PipelineStages(CONFIG, broker=None, instances={} if instances is None else instances,
                            blocks_in_engine=lambda model: blocks_here, require_checkpoint=checked.append,
                            engine_thread=unusable("engine thread"), transport=unusable("transport"))
    return stages, checked


def _op(second: str = "w2") -> m.StartPipeline:
    return m.StartPipeline(instance_id="pipe-1", model="m", path="/ckpt", peers={"w1": "a:1", second: "b:2"},
                           stages=[m.Stage(worker_id="w1", block_start=0, block_end=2),
                                   m.Stage(worker_id=second, block_start=2, block_end=4)])


async def test_a_worker_that_runs_no_stage_refuses():
    stages, checked = _stages({2: object(), 3: object()})
    with pytest.raises(DomainError, match="w2 runs no stage of pipeline pipe-1"):
        await stages.start(_op(second="w3"))
    assert checked == []


async def test_a_stage_whose_blocks_are_not_all_in_engine_memory_is_refused_before_the_checkpoint_is_read():
    stages, checked = _stages({2: object()})
    with pytest.raises(DomainError, match=r"does not hold blocks \[3\] of m") as e:
        await stages.start(_op())
    assert e.value.code == "conflict" and checked == [] and stages.hosted == {}


async def test_a_pipeline_already_served_here_is_acknowledged_again():
    stages, checked = _stages({}, instances={"pipe-1": object()})
    ack = await stages.start(_op())
    assert ack.accepted and ack.detail == "already serving" and checked == []
