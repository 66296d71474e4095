"""The worker's side of block multicasts: runs TransferPart commands on its data plane.

Shared by the worker (blocks come from and go to its host tier) and by the bare
data-plane node the multicast benchmark runs in emulated cluster namespaces
(synthetic blocks): the same command, executor, events and report in both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch
from opentelemetry import trace
from prometheus_client import Counter

from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import DomainError, publish
from libs.telemetry import tracer
from libs.transfer.base import BlockSlot, Transport, TransferError
from libs.transfer.executor import Hop, PartRun

log = logging.getLogger(__name__)
_tracer = tracer("worker")

TRANSFER_BYTES = Counter("layercast_worker_transfer_bytes_total", "Block bytes moved by multicasts",
                         ["direction", "algorithm"])
CANCELLED_REMEMBERED = 256  # cancelled transfer ids kept, to refuse a part that comes after its cancel


class BlockStore(Protocol):
    """Where a transfer finds the blocks it sends and puts the blocks it receives."""

    def take(self, model: str, block_id: int) -> torch.Tensor | None:
        """A held block's buffer, kept (not evicted) until release()."""

    async def release(self, model: str, block_id: int) -> None:
        """The transfer no longer needs a block it took."""

    async def missing(self, model: str, block_id: int) -> None:
        """A block the part must send is not held: whoever planned it had a stale record."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A fresh host buffer for a block to be received."""

    async def store(self, model: str, block_id: int, buffer: torch.Tensor) -> None:
        """A received, verified block: keep it (e.g. in the host tier)."""

    async def part_ended(self, part: m.TransferPart, ok: bool) -> None:
        """The part is over (every stored block was stored before this); receives that did not
        arrive never will."""


class TransferAgent:
    def __init__(self, broker, transport: Transport, worker_id: str, blocks: BlockStore,
                 on_received: Callable[[int, float], None] | None = None):
        self.broker = broker
        self.transport = transport
        self.worker_id = worker_id
        self.blocks = blocks
        # (bytes, seconds) a part received, from its first byte to its last block: the worker
        # folds it into its network_to_host rate, which the planner's chain planner reads.
        self.on_received = on_received
        self.running: dict[str, PartRun] = {}
        self._tasks: set[asyncio.Task] = set()
        self._cancelled: OrderedDict[str, str] = OrderedDict()  # transfer id -> why; the latest few

    def cancel(self, transfer_id: str, reason: str) -> bool:
        """Stop the part now (its run ends within a poll, its report says why); a part of this
        transfer that arrives later is refused. False: none was running."""
        self._cancelled[transfer_id] = reason or "cancelled"
        while len(self._cancelled) > CANCELLED_REMEMBERED:
            self._cancelled.popitem(last=False)
        run = self.running.get(transfer_id)
        if run is None:
            return False
        log.info("transfer %s cancelled on %s: %s", transfer_id, self.worker_id, reason)
        run.cancel()
        return True

    async def accept(self, part: m.TransferPart) -> m.CommandAck:
        """Prepare the part (buffers, receive registrations) and start it; ack once ready to receive."""
        if part.transfer_id in self.running:
            return m.CommandAck(accepted=True, detail="already running")
        if part.transfer_id in self._cancelled:
            raise DomainError(f"transfer {part.transfer_id} was cancelled: {self._cancelled[part.transfer_id]}",
                              code="conflict")
        infos = {b.block_id: b for b in part.blocks}
        received = {h.block for h in part.receives}
        slots: dict[int, BlockSlot] = {}
        taken: list[int] = []
        try:
            for b in sorted({h.block for h in part.sends} - received):
                buf = self.blocks.take(part.model, b)
                if buf is None:
                    await self.blocks.missing(part.model, b)
                    raise DomainError(f"{self.worker_id} does not hold block {b} of {part.model} it must send",
                                      code="not_found")
                taken.append(b)
                if buf.numel() * buf.element_size() < infos[b].nbytes:
                    raise DomainError(f"block {b} of {part.model} on {self.worker_id} is smaller than "
                                      f"{infos[b].nbytes} bytes", code="conflict")
                slots[b] = BlockSlot(b, buf, infos[b].nbytes, complete=True)
            for b in sorted(received):
                slots[b] = BlockSlot(b, self.blocks.allocate(infos[b].nbytes), infos[b].nbytes)
            checksums = {b: int(infos[b].checksum, 16) for b in received}
            announced: list = []
            run = PartRun(
                self.transport, part.transfer_id, slots=slots,
                sends=[Hop(h.step, h.peer, h.block) for h in part.sends],
                receives=[Hop(h.step, h.peer, h.block) for h in part.receives],
                peers=part.peers, checksums=checksums, on_block=self._announcer(part, announced),
                chunk_bytes=part.chunk_bytes, stall_timeout_s=part.stall_timeout_s)
        except (ValueError, TransferError) as e:
            await self._release(part.model, taken)
            raise DomainError(f"transfer {part.transfer_id}: {e}") from e
        except BaseException:
            await self._release(part.model, taken)
            raise
        self.running[part.transfer_id] = run
        task = asyncio.create_task(self._run(part, run, taken, announced))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return m.CommandAck(accepted=True, detail="ready")

    def _announcer(self, part: m.TransferPart, announced: list):
        loop = asyncio.get_running_loop()
        t0 = time.time()

        def on_block(block_id: int, slot: BlockSlot) -> None:
            # Called on the executor's thread the moment a block is verified: keep it, then tell everyone.
            seconds = (slot.completed_at or time.time()) - t0
            announced.append(asyncio.run_coroutine_threadsafe(self._arrived(part, block_id, slot, seconds), loop))

        return on_block

    async def _arrived(self, part: m.TransferPart, block_id: int, slot: BlockSlot, seconds: float) -> None:
        try:
            await self.blocks.store(part.model, block_id, slot.buffer[: slot.nbytes])
            await publish(self.broker, subjects.EVENT_BLOCK, m.BlockEvent(
                model=part.model, block_id=block_id, worker_id=self.worker_id, tier=m.Tier.host,
                state=m.ReplicaState.ready, nbytes=slot.nbytes, seconds=seconds, scale_op_id=part.scale_op_id))
        except Exception:
            log.exception("announcing block %d of %s failed", block_id, part.model)

    async def _run(self, part: m.TransferPart, run: PartRun, taken: list[int], announced: list) -> None:
        with _tracer.start_as_current_span("worker.transfer", attributes={
                "layercast.model": part.model, "layercast.worker": self.worker_id,
                "layercast.transfer": part.transfer_id, "layercast.algorithm": part.algorithm,
                "layercast.sends": len(part.sends), "layercast.receives": len(part.receives)}) as span:
            started = time.time()
            try:
                result = await asyncio.to_thread(run.run)
                report = m.TransferReport(
                    transfer_id=part.transfer_id, worker_id=self.worker_id, model=part.model, ok=True,
                    started_at=result.started_at, finished_at=result.finished_at,
                    block_arrived_at=result.block_arrived_at, first_byte_at=result.first_byte_at,
                    bytes_sent=result.bytes_sent,
                    bytes_received=result.bytes_received, scale_op_id=part.scale_op_id)
                if self.on_received and result.bytes_received and result.first_byte_at and result.block_arrived_at:
                    self.on_received(result.bytes_received, max(result.block_arrived_at.values()) - result.first_byte_at)
                TRANSFER_BYTES.labels("sent", part.algorithm).inc(result.bytes_sent)
                TRANSFER_BYTES.labels("received", part.algorithm).inc(result.bytes_received)
                span.set_attribute("layercast.bytes_received", result.bytes_received)
                span.set_attribute("layercast.bytes_sent", result.bytes_sent)
            except Exception as e:
                log.warning("transfer %s of %s failed on %s: %s", part.transfer_id, part.model, self.worker_id, e)
                span.record_exception(e)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
                report = m.TransferReport(
                    transfer_id=part.transfer_id, worker_id=self.worker_id, model=part.model, ok=False,
                    error=str(e), started_at=started, finished_at=time.time(), scale_op_id=part.scale_op_id)
            finally:
                self.running.pop(part.transfer_id, None)
                await self._release(part.model, taken)
            # Every block event goes out before the report that ends the part.
            await asyncio.gather(*(asyncio.wrap_future(f) for f in announced), return_exceptions=True)
            await self.blocks.part_ended(part, report.ok)
            await publish(self.broker, subjects.EVENT_TRANSFER, report)

    async def _release(self, model: str, blocks: list[int]) -> None:
        for b in blocks:
            await self.blocks.release(model, b)

    async def stop(self) -> None:
        for run in list(self.running.values()):
            run.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
