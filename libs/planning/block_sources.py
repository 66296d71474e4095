"""Where each block of a worker's load comes from: its host tier, a running transfer, or disk.

The worker's loader (services/worker/loading.py) carries the choice out; this is only the
choice, so it is pure: block ids in, a source per block out.

* A block a running transfer is bringing is awaited, but only where the load command names an
  incoming transfer (`LoadModel.incoming_transfer`); it is awaited even if the host tier
  holds it, as the load has always done.
* Else a block the host tier holds is used from there (never re-read).
* Every other block is read from disk, in the order the load wants them.

When a transfer ends without a block the load was waiting for, :func:`reread_lost` moves that
block, and every later one still expected from the transfer that has not arrived, to disk:
what the transfer did not deliver by its end never comes.
"""

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


class BlockSource(enum.Enum):
    host = "host"
    transfer = "transfer"
    disk = "disk"


@dataclass(frozen=True)
class BlockSources:
    """A load's choice: `wanted` in load order, and the source of each."""

    wanted: tuple[int, ...]
    sources: Mapping[int, BlockSource]

    def of(self, block_id: int) -> BlockSource:
        return self.sources[block_id]

    def blocks(self, source: BlockSource) -> list[int]:
        """The blocks from `source`, in load order."""
        return [b for b in self.wanted if self.sources[b] is source]

    @property
    def disk(self) -> list[int]:
        """The disk reads, in load order."""
        return self.blocks(BlockSource.disk)


def choose_block_sources(wanted: Sequence[int], in_host: Collection[int], arriving: Collection[int],
                         incoming_transfer: bool) -> BlockSources:
    """Each wanted block's source. `in_host`: blocks the host tier holds; `arriving`: blocks a
    running transfer is bringing (used only when `incoming_transfer`)."""
    order = tuple(wanted)
    if len(set(order)) != len(order):
        raise ValueError(f"wanted blocks repeat: {list(order)}")
    sources: dict[int, BlockSource] = {}
    for b in order:
        if incoming_transfer and b in arriving:
            sources[b] = BlockSource.transfer
        elif b in in_host:
            sources[b] = BlockSource.host
        else:
            sources[b] = BlockSource.disk
    return BlockSources(order, sources)


def reread_lost(plan: BlockSources, lost_block: int, arrived: Collection[int]) -> tuple[BlockSources, list[int]]:
    """The transfer ended without `lost_block`: it, and each later block still expected from the
    transfer that is not in `arrived`, go to disk. Returns the new choice and the new disk
    reads in load order (earlier blocks are already loaded, so they stay as they were)."""
    if plan.sources.get(lost_block) is not BlockSource.transfer:
        raise ValueError(f"block {lost_block} was not expected from a transfer")
    later = plan.wanted[plan.wanted.index(lost_block):]
    lost = [b for b in later if plan.sources[b] is BlockSource.transfer and (b == lost_block or b not in arrived)]
    sources = dict(plan.sources)
    sources.update(dict.fromkeys(lost, BlockSource.disk))
    return BlockSources(plan.wanted, sources), lost
