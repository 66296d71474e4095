"""A worker's part in execution pipelines (λScale §4.3): stages it hosts, pipelines it heads.

A StartPipeline names every stage of a pipeline; this worker runs its own. A later stage
becomes a LocalStage over blocks this worker's load has already made ready (views: no copy)
and is served to the entry by the worker's StageServer over the data plane's message
connections (activations never go over NATS). The entry stage builds an engine whose other
stages are RemoteStages and attaches it like any instance: batching, sampling and token
streaming stay as for a local instance, and the engine keeps one micro-batch per stage in
flight (2D pipelining).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Protocol

import torch
from faststream.nats import NatsBroker

from libs.bus.broker import DomainError, publish
from libs.checkpoint import CheckpointIndex
from libs.engine import Engine, LayerRange, RemoteStage, StageServer, budgeted_stage
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.transfer.base import Transport
from services.worker.loading import Instance

log = logging.getLogger(__name__)

# A stage that has not answered by then has failed (its worker died or its link broke): the
# pipeline fails and the gateway hands its requests over.
STAGE_TIMEOUT_S = 10.0


def stage_id(instance_id: str, index: int) -> str:
    return f"{instance_id}/{index}"


class StageConfig(Protocol):
    """The worker settings a pipeline's stages are built with (WorkerConfig has them)."""

    worker_id: str
    device: str
    max_batch_size: int
    max_seq_len: int
    kv_cache_bytes: int


class EngineAttach(Protocol):
    """The worker's engine thread, as an entry stage's engine joins it (EngineRuntime)."""

    def attach(self, instance_id: str, engine: Engine) -> None: ...


class PipelineStages:
    def __init__(self, config: StageConfig, *, broker: NatsBroker, instances: MutableMapping[str, Instance],
                 blocks_in_engine: Callable[[str], dict[int, torch.Tensor]],
                 require_checkpoint: Callable[[str], None], engine_thread: Callable[[], EngineAttach],
                 transport: Callable[[], Transport]):
        """`instances`: the worker's (an entry stage's pipeline joins them); `blocks_in_engine(model)`:
        the blocks its loads made ready (stages run over them); `require_checkpoint(path)` raises
        when this worker cannot read the checkpoint; `engine_thread` and `transport` give the
        worker's once it has started them."""
        self.config = config
        self.broker = broker
        self.instances = instances
        self.blocks_in_engine = blocks_in_engine
        self.require_checkpoint = require_checkpoint
        self.engine_thread = engine_thread
        self.transport = transport
        self.server: StageServer | None = None
        self.hosted: dict[str, list[str]] = {}  # pipeline instance -> stage ids hosted here

    def stage_server(self) -> StageServer:
        """The worker's StageServer (started on first use): pipeline stages and live pairs' fronts."""
        return self._server()

    def _server(self) -> StageServer:
        if self.server is None:
            self.server = StageServer(self.transport(), {})
        return self.server

    async def start(self, op: m.StartPipeline) -> m.CommandAck:
        c = self.config
        me = c.worker_id
        index = next((i for i, s in enumerate(op.stages) if s.worker_id == me), None)
        if index is None:
            raise DomainError(f"{me} runs no stage of pipeline {op.instance_id}")
        if op.instance_id in self.hosted or op.instance_id in self.instances:
            return m.CommandAck(accepted=True, detail="already serving")
        stage = op.stages[index]
        blocks = self.blocks_in_engine(op.model)
        missing = [b for b in range(stage.block_start, stage.block_end) if b not in blocks]
        if missing:
            raise DomainError(f"{me} does not hold blocks {missing} of {op.model} in engine memory", code="conflict")
        self.require_checkpoint(op.path)
        checkpoint = await asyncio.to_thread(CheckpointIndex.load, op.path)

        def build_local():
            model = LayerRange(checkpoint, {b: blocks[b] for b in range(stage.block_start, stage.block_end)},
                               stage.block_start, stage.block_end, device=c.device)
            return budgeted_stage(model, c.max_batch_size, c.max_seq_len, c.kv_cache_bytes)

        local = await asyncio.to_thread(build_local)
        if index > 0:
            server = self._server()
            entry = op.stages[0].worker_id
            server.add(stage_id(op.instance_id, index), local, caller=entry, address=op.peers[entry])
            self.hosted[op.instance_id] = [stage_id(op.instance_id, index)]
            log.info("pipeline %s: stage %d (blocks [%d, %d)) served here", op.instance_id, index,
                     stage.block_start, stage.block_end)
            return m.CommandAck(accepted=True, detail=f"stage {index} hosted")
        remotes = [RemoteStage(self.transport(), s.worker_id, op.peers[s.worker_id], stage_id(op.instance_id, i),
                               slots=local.slots, timeout_s=STAGE_TIMEOUT_S)
                   for i, s in enumerate(op.stages) if i > 0]
        engine = Engine(checkpoint, device=c.device, max_batch_size=c.max_batch_size, max_seq_len=c.max_seq_len,
                        stages=[local, *remotes], tokenizer_dir=op.path)
        self.engine_thread().attach(op.instance_id, engine)
        now = time.time()
        info = m.InstanceInfo(instance_id=op.instance_id, model=op.model, mode="pipeline", stages=op.stages,
                              state=m.InstanceState.ready, created_at=now, ready_at=now, loaded_at=now,
                              scale_op_id=op.scale_op_id, max_batch=engine.max_batch_size)
        self.instances[op.instance_id] = Instance(info=info, path=op.path, keys=[])
        await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(
            instance=info, reason=f"execution pipeline of {len(op.stages)} stages serving"))
        log.info("pipeline %s of %s serving: %s", op.instance_id, op.model,
                 ", ".join(f"{s.worker_id}[{s.block_start},{s.block_end})" for s in op.stages))
        return m.CommandAck(accepted=True, detail="pipeline serving")

    def stop_hosting(self, instance_id: str) -> bool:
        """Stop serving this pipeline's stages here; False if none are hosted here."""
        ids = self.hosted.pop(instance_id, None)
        if ids is None:
            return False
        for sid in ids:
            self.server.remove(sid)
        return True

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
