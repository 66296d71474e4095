"""`python -m benchmarks.dataplane_node`: a worker's data plane alone, for multicast benchmarks.

It runs the worker's TransferAgent (same TransferPart command, executor, TCP
transport, block events and reports) without an engine or a registry, over
synthetic blocks: a node started with `--holds` generates the model's blocks
deterministically from a seed (so a controller can compute their checksums),
the others receive them. Received blocks are verified and then dropped: a
benchmark repeats multicasts and must not accumulate copies.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from libs.checkpoint.fastload import aligned_empty
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import rpc
from libs.transfer.tcp.transport import TcpTransport
from services.common.runner import Service, run
from services.worker.transfers import TransferAgent


def synthetic_block(seed: int, block_id: int, nbytes: int) -> torch.Tensor:
    """Block `block_id` of a synthetic model: pseudo-random bytes, the same on every node for one seed."""
    data = np.random.default_rng([seed, block_id]).bytes(nbytes)
    buf = aligned_empty(nbytes)[:nbytes]
    buf.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return buf


def synthetic_block_sizes(total_bytes: int, n_blocks: int) -> list[int]:
    """Near-equal block sizes summing to total_bytes."""
    base, rem = divmod(total_bytes, n_blocks)
    return [base + (1 if b < rem else 0) for b in range(n_blocks)]


class _SyntheticBlocks:
    def __init__(self, model: str, blocks: dict[int, torch.Tensor]):
        self.model = model
        self.held = blocks

    def take(self, model: str, block_id: int) -> torch.Tensor | None:
        return self.held.get(block_id) if model == self.model else None

    async def release(self, model: str, block_id: int) -> None:
        return None  # synthetic blocks stay for the node's lifetime

    async def missing(self, model: str, block_id: int) -> None:
        return None  # a benchmark node has no registry record to correct

    def allocate(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes)

    async def store(self, model: str, block_id: int, buffer: torch.Tensor) -> None:
        return None  # verified and announced; dropped so repeated runs do not pile up copies

    async def part_ended(self, part, ok: bool) -> None:
        return None


class DataPlaneNode(Service):
    name = "dataplane"

    def __init__(self, node_id: str, listen_host: str, listen_port: int, model: str, blocks: dict[int, torch.Tensor],
                 nats_url: str | None = None):
        super().__init__(nats_url)
        self.node_id = node_id
        self.transport = TcpTransport(node_id, listen_host, listen_port)
        self.agent = TransferAgent(self.broker, self.transport, node_id, _SyntheticBlocks(model, blocks))

        @self.broker.subscriber(subjects.worker_command(node_id))
        @rpc(m.TransferPart)
        async def transfer(part: m.TransferPart) -> m.CommandAck:
            return await self.agent.accept(part)

    async def stop(self) -> None:
        await self.agent.stop()
        self.transport.close()
        await super().stop()


def main() -> None:
    env = os.environ.get
    p = argparse.ArgumentParser(description="layercast data-plane node (multicast benchmarks)")
    p.add_argument("--node-id", required=True)
    p.add_argument("--listen", required=True, help="host:port of the data plane")
    p.add_argument("--model", default="synthetic")
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--holds", action="store_true", help="generate and hold every block (a source)")
    p.add_argument("--health-host", default=env("LAYERCAST_HEALTH_HOST", "127.0.0.1"))
    p.add_argument("--health-port", type=int, default=int(env("LAYERCAST_HEALTH_PORT", "0")))
    a = p.parse_args()
    host, _, port = a.listen.rpartition(":")
    sizes = synthetic_block_sizes(a.size_bytes, a.blocks)
    blocks = {b: synthetic_block(a.seed, b, n) for b, n in enumerate(sizes)} if a.holds else {}
    run(lambda: DataPlaneNode(a.node_id, host, int(port), a.model, blocks), a.health_host, a.health_port)


if __name__ == "__main__":
    main()
