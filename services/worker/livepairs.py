"""A worker's side of live pairs (BlitzScale §5.2; the engine part is libs/engine/livepair.py).

A FormLivePair names both sides. On the target (an instance still loading, stop-the-world)
the worker's StageServer hosts a `PrefillFront` over the blocks its load has made ready so
far (views: no copy; it never waits for a block: the source asks what it holds first). On the
source (an instance serving every block) the engine is paired with a `RemoteFront` to it and
a ZigZag `PrefillSplitter`: each prefill batch asks the target which leading blocks it holds,
runs that many there (capped), and gets their KV back with the hidden state. Whether an
instance may pair, and when the pair ends, is its lifecycle's (libs/planning/instance.py):
this module carries out StartPair and EndPair, and tells the other worker when this side
ends the pair (EndLivePair) — the target's last block dissolves it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch
from faststream.nats import NatsBroker
from prometheus_client import Counter

from libs.bus.broker import DomainError, call
from libs.checkpoint import CheckpointIndex
from libs.engine import LayerRange, RemoteStage
from libs.engine.livepair import PrefillFront, RemoteFront
from libs.planning import instance as lifecycle
from libs.planning.livepair import PrefillSplitter
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.transfer.base import Transport
from services.worker.loading import InstanceLoading
from services.worker.pipelines import STAGE_TIMEOUT_S, PipelineStages, StageConfig

log = logging.getLogger(__name__)

# Every split a live pair's source chose for a batch of prefills (blocks: how many ran on the
# target, 0: none), by its policy: what a pair offloaded, not just that it formed.
SPLITS = Counter("layercast_worker_live_pair_prefill_batches_total",
                 "Prefill batches of a live pair's source, by split policy and blocks run on the target",
                 ["policy", "blocks"])


def front_id(instance_id: str) -> str:
    """The stage id a target's front is served under."""
    return f"{instance_id}/front"


class _Landed:
    """A BlockSource over the blocks a load has made ready so far (a dict the load fills)."""

    def __init__(self, blocks: dict[int, torch.Tensor]):
        self.blocks = blocks

    def ready(self, block_id: int) -> bool:
        return block_id in self.blocks

    def wait(self, block_id: int, timeout: float | None = None) -> torch.Tensor:
        try:
            return self.blocks[block_id]
        except KeyError:  # the source asks what is held before it splits: never reached in a pair
            raise RuntimeError(f"block {block_id} is not here yet") from None


class LivePairs:
    def __init__(self, config: StageConfig, *, broker: NatsBroker, loading: InstanceLoading,
                 pipelines: PipelineStages, engine_thread: Callable[[], object], transport: Callable[[], Transport]):
        self.config = config
        self.broker = broker
        self.loading = loading
        self.pipelines = pipelines
        self.engine_thread = engine_thread
        self.transport = transport
        self.peer: dict[str, tuple[str, str]] = {}  # instance paired here -> (peer worker, peer instance)
        self.fronts: dict[str, PrefillFront] = {}  # target instance -> its front, hosted here
        self.splitters: dict[str, PrefillSplitter] = {}  # source instance -> its per-batch split
        loading.on_pair_end = self.ended

    async def form(self, op: m.FormLivePair) -> m.CommandAck:
        me = self.config.worker_id
        if me == op.source_worker:
            role, iid, peer = "source", op.source_instance, (op.target_worker, op.target_instance)
        elif me == op.target_worker:
            role, iid, peer = "target", op.target_instance, (op.source_worker, op.source_instance)
        else:
            raise DomainError(f"{me} is neither side of the live pair {op.source_instance}/{op.target_instance}")
        effects = self.loading.step(iid, lifecycle.PairFormed(role, f"{peer[0]}/{peer[1]}"))
        answer = m.CommandAck(accepted=True, detail="")
        for e in effects:
            match e:
                case lifecycle.Refuse():
                    raise DomainError(f"instance {iid} on {me}: {e.detail}", code=e.code)
                case lifecycle.StartPair():
                    self.peer[iid] = peer
                    try:
                        await (self._start_source(iid, op) if role == "source" else self._start_target(iid, op))
                    except Exception as err:
                        await self.loading.feed(iid, lifecycle.PairEnded(f"could not start: {err}"))
                        raise DomainError(f"live pair of {iid} on {me} could not start: {err}") from err
                case lifecycle.Answer():
                    answer = m.CommandAck(accepted=e.accepted, detail=e.detail)
        return answer

    async def end(self, op: m.EndLivePair) -> m.CommandAck:
        """The other side ended the pair: this side stops its part."""
        effects = await self.loading.feed(op.instance_id, lifecycle.PairEnded(op.reason))
        return m.CommandAck(accepted=True, detail="unpaired" if effects else "not paired")

    async def _start_target(self, iid: str, op: m.FormLivePair) -> None:
        c = self.config
        index = await asyncio.to_thread(CheckpointIndex.load, op.path)
        # The load's own dict of ready blocks (the load fills it as blocks land).
        landed = self.loading.in_engine.setdefault(iid, (op.model, {}))[1]
        cap = op.max_target_blocks or index.n_blocks // 2

        def build() -> PrefillFront:
            return PrefillFront(LayerRange(index, _Landed(landed), device=c.device), c.max_batch_size,
                                c.max_seq_len, max_blocks=min(cap, index.n_blocks - 1))

        front = await asyncio.to_thread(build)
        server = self.pipelines.stage_server()
        server.add(front_id(iid), front, caller=op.source_worker, address=op.peers[op.source_worker])
        self.fronts[iid] = front
        log.info("live pair: %s lends its first blocks (up to %d) to %s", iid, front.max_blocks, op.source_instance)

    async def _start_source(self, iid: str, op: m.FormLivePair) -> None:
        index = await asyncio.to_thread(CheckpointIndex.load, op.path)
        stage = RemoteStage(self.transport(), op.target_worker, op.peers[op.target_worker],
                            front_id(op.target_instance), slots=self.config.max_batch_size, timeout_s=STAGE_TIMEOUT_S)
        remote = RemoteFront(stage, index)
        splitter = PrefillSplitter(index.n_blocks, cap=min(op.max_target_blocks or index.n_blocks // 2,
                                                           index.n_blocks - 1), policy=op.split)

        def split(keys: list[str]) -> int:
            if splitter.fixed is None:  # zigzag: every batch; fixed: until its split is decided
                splitter.held(remote.held())  # one round trip a batch: what the target holds now
            blocks = splitter(keys)
            SPLITS.labels(splitter.policy, str(blocks)).inc()
            return blocks

        runtime = self.engine_thread()
        loop = asyncio.get_running_loop()

        def lost(error: str) -> None:  # engine thread: the target failed, the engine went on alone
            loop.call_soon_threadsafe(lambda: self.loading.spawn(self.loading.feed(iid, lifecycle.PairLost(error))))

        def pair() -> None:
            engine = runtime.engine_of(iid)
            if engine is None:
                raise RuntimeError(f"instance {iid} has no engine here")
            engine.pair_with(remote, split, on_lost=lost)

        await runtime.call(pair)
        self.splitters[iid] = splitter
        log.info("live pair: %s offloads prefills to %s on %s (split: %s)", iid, op.target_instance,
                 op.target_worker, op.split)

    async def ended(self, iid: str, e: lifecycle.EndPair) -> None:
        """EndPair: stop this side's part; tell the other worker if this side ended it."""
        peer = self.peer.pop(iid, None)
        front = self.fronts.pop(iid, None)
        if front is not None and self.pipelines.server is not None:
            self.pipelines.server.remove(front_id(iid))
        if self.splitters.pop(iid, None) is not None:
            runtime = self.engine_thread()

            def unpair() -> None:
                engine = runtime.engine_of(iid)
                if engine is not None and engine.paired:
                    engine.unpair()

            await runtime.call(unpair)
        log.info("live pair of %s ended: %s", iid, e.reason)
        if e.notify_peer and peer is not None:  # beside the step: a target attaching waits for no reply
            self.loading.spawn(self._tell(*peer, e.reason))

    async def _tell(self, worker: str, instance: str, reason: str) -> None:
        try:
            await call(self.broker, subjects.worker_peer(worker),
                       m.EndLivePair(instance_id=instance, reason=reason), m.CommandAck, timeout=5.0)
        except Exception as err:  # a peer that is gone needs no notice (its side ended with it)
            log.warning("could not tell %s that the live pair of %s ended: %s", worker, instance, err)
