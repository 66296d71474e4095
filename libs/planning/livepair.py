"""Live pairs (BlitzScale §5.2): which instances pair, and how each batch's prefill is split.

`choose_live_pairs` is the planner's decision: an instance overloaded (its queue's wait past
its SLO) pairs with an instance of the same model still receiving it (a chain target), the
target that will take longest to load first (the paper: "typically the tail instances in the
chains as it has the slowest link"), and only where waiting for the load to end would itself
break the SLO. `PrefillSplitter` is the source's per-batch decision at run time, over the
ILP-free ZigZag queue (zigzag.ZigZagQueue). Pure: no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from libs.protocol import messages as m

from .zigzag import ZigZagQueue

__all__ = ["SPLIT_POLICIES", "LivePair", "PrefillSplitter", "Receiving", "Serving", "choose_live_pairs",
           "form_live_pair", "leading_blocks"]

# How a live pair's source splits its prefill batches: "zigzag", per batch at run time over the
# ZigZag queue (the split grows with the blocks the target holds); "fixed", the comparison
# (BlitzScale Fig. 15a's best-effort, fixed per pair): the first batch the target can take
# runs what it holds then (capped), and so does every later batch.
SPLIT_POLICIES = ("zigzag", "fixed")


def leading_blocks(in_engine: Iterable[int]) -> int:
    """Blocks 0..k-1 all held: what a target can run of a prefill (the first k blocks)."""
    held = set(in_engine)
    k = 0
    while k in held:
        k += 1
    return k


class PrefillSplitter:
    """How many leading blocks each batch of prefills runs on the loading target.

    Each batch enters a ZigZagQueue over blocks (Fig. 16); the target takes it one block at a
    time while its next block is held, up to `cap` (by default half the model: past it the
    target, still receiving, is the bottleneck), and the source then pulls it with the blocks
    done. The hand-off here is synchronous (the source asks for a batch's front when it runs
    the batch), so one batch is in the queue at a time and the split is what the target holds
    when the batch starts, capped; it grows as blocks arrive (`held`). `policy="fixed"` is the
    comparison (SPLIT_POLICIES): the first split above 0 is kept for every later batch."""

    def __init__(self, n_blocks: int, held: int = 0, cap: int | None = None, policy: str = "zigzag"):
        if policy not in SPLIT_POLICIES:
            raise ValueError(f"unknown split policy {policy!r}; choose from {', '.join(SPLIT_POLICIES)}")
        self.policy = policy
        self._fixed: int | None = None  # policy "fixed": the split, once the target could take a batch
        if n_blocks < 2:
            raise ValueError(f"a live pair needs a model of at least 2 blocks, got {n_blocks}")
        self.n_blocks = n_blocks
        self.cap = n_blocks // 2 if cap is None else cap
        if not 0 <= self.cap < n_blocks:
            raise ValueError(f"cap must leave the source a block: 0 <= cap < {n_blocks}, got {self.cap}")
        self.queue = ZigZagQueue(n_blocks, held)
        self._batches = itertools.count()
        self.splits: list[int] = []  # every decision, in order

    @property
    def fixed(self) -> int | None:
        """Policy "fixed", once decided: the split every batch gets; None otherwise."""
        return self._fixed

    def held(self, n_leading_blocks: int) -> None:
        """The target now holds blocks 0..n-1 (never fewer than before)."""
        self.queue.set_loaded(n_leading_blocks)

    def __call__(self, request_ids: Sequence[str] = ()) -> int:
        """The split of the next batch: blocks [0, k) on the target, [k, n) on the source."""
        if self.policy == "fixed" and self._fixed is not None:
            self.splits.append(self._fixed)
            return self._fixed
        batch = next(self._batches)
        self.queue.push(batch)
        while self.queue.executed(batch) < self.cap:
            if self.queue.next_for_target() is None:
                break  # its next block is not held yet
            self.queue.target_done(batch)
        pulled = self.queue.pull_for_source()
        assert pulled is not None and pulled[0] == batch
        if self.policy == "fixed" and pulled[1]:
            self._fixed = pulled[1]
        self.splits.append(pulled[1])
        return pulled[1]


@dataclass(frozen=True)
class Serving:
    """An instance serving every block, with the wait its queue gives a new request."""

    instance_id: str
    worker_id: str
    model: str
    queue_wait_s: float
    slo_s: float
    paired: bool = False
    load: int = 0  # running requests on its worker: among equally overloaded sources, the busiest pairs first

    @property
    def overloaded(self) -> bool:
        return self.queue_wait_s > self.slo_s


@dataclass(frozen=True)
class Receiving:
    """An instance of the model still loading (a chain target), and when its load will end."""

    instance_id: str
    worker_id: str
    model: str
    load_left_s: float
    paired: bool = False


@dataclass(frozen=True)
class LivePair:
    source: Serving
    target: Receiving


def choose_live_pairs(serving: Sequence[Serving], receiving: Sequence[Receiving]) -> list[LivePair]:
    """Pair each overloaded, unpaired instance with an unpaired target of its model that loads
    for longer than the source's SLO (a stop-the-world load would break it: BlitzScale's
    criterion (1)); the most overloaded sources first, each taking the slowest target left (the
    chain's tail). An instance is in one pair at most; never two instances of one worker."""
    sources = sorted((s for s in serving if s.overloaded and not s.paired),
                     key=lambda s: (-(s.queue_wait_s - s.slo_s), -s.load, s.instance_id))
    free = [r for r in receiving if not r.paired]
    pairs: list[LivePair] = []
    for src in sources:
        fits = [r for r in free if r.model == src.model and r.worker_id != src.worker_id
                and r.load_left_s > src.slo_s]
        if not fits:
            continue
        target = max(fits, key=lambda r: (r.load_left_s, r.instance_id))
        free.remove(target)
        pairs.append(LivePair(src, target))
    return pairs


def form_live_pair(pair: LivePair, path: str, addresses: dict[str, str], max_target_blocks: int | None = None,
                   scale_op_id: str | None = None) -> m.FormLivePair:
    """The command both workers of `pair` get (the target's first, then the source's);
    `addresses`: worker -> data-plane address (WorkerInfo.data_address)."""
    src, tgt = pair.source, pair.target
    return m.FormLivePair(model=src.model, path=path, source_instance=src.instance_id, source_worker=src.worker_id,
                          target_instance=tgt.instance_id, target_worker=tgt.worker_id,
                          peers={w: addresses[w] for w in (src.worker_id, tgt.worker_id)},
                          max_target_blocks=max_target_blocks, scale_op_id=scale_op_id)
