"""Micro-batches of a pipeline's rows kept in flight across steps (2D pipelining, λScale Fig. 6a).

A pipeline of `s` stages keeps up to `s` micro-batches in flight continuously: while stage 2
computes micro-batch 1's step t, stage 1 computes micro-batch 2's step t, and a micro-batch's
next step enters stage 1 as soon as its previous token is sampled, without waiting for the
other micro-batches (no step-wide barrier that fills and drains the stages every step).

`MicroBatchSchedule` decides which rows (a request's KV slot: any hashable key) go together,
and follows each micro-batch through the stages:

- `next_group(decodes, prefills)`: the rows the next micro-batch takes, when a slot is free.
  Rows already in flight never go again (a row's steps run in order: its step t + 1 starts only
  once step t has left the last stage). The rows are shared out so that the `s` micro-batches
  stay about equal: a micro-batch takes at most ceil(n / s) rows, n the rows in flight or
  ready, decoding rows first (a prompt's rows join one with room for them; a micro-batch whose
  prefill landed decodes as one group, its rows at the same step).
- `start(decodes, prefills)` puts a micro-batch in flight, queued at stage 0;
  `passed(id)` moves it past the stage it is at (True once it left the last: out of flight).
- Each stage serves its queue in order (`at`, `queue`): a micro-batch passes stage i only
  after every micro-batch that entered stage i before it (a stage computes one at a time).

Pure: row keys in, groups and positions out (libs.engine's Engine drives it).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MicroBatch:
    id: int
    decodes: tuple[Hashable, ...]  # rows decoding one token
    prefills: tuple[Hashable, ...]  # rows taking a prompt chunk

    @property
    def rows(self) -> tuple[Hashable, ...]:
        return self.decodes + self.prefills


def _share(ready: int, busy: int, stages: int) -> int:
    """Rows one micro-batch takes: an s-th of every such row (those in flight included), rounded up."""
    return -(-(ready + busy) // stages)


class MicroBatchSchedule:
    def __init__(self, stages: int):
        if stages < 1:
            raise ValueError(f"a pipeline has at least one stage, got {stages}")
        self.stages = stages
        self._ids = itertools.count()
        self._flight: dict[int, MicroBatch] = {}  # in flight, in the order they started
        self._at: dict[int, int] = {}  # micro-batch id -> the stage it is at (computing or queued)

    @property
    def in_flight(self) -> list[MicroBatch]:
        """Micro-batches in flight, each stage's in the order they reached it."""
        return list(self._flight.values())

    def free(self) -> int:
        """Micro-batches that may start now."""
        return self.stages - len(self._flight)

    def busy(self) -> set[Hashable]:
        """Rows in flight."""
        return {r for mb in self._flight.values() for r in mb.rows}

    def at(self, mb_id: int) -> int:
        """The stage the micro-batch is at (computing there or queued for it)."""
        return self._at[mb_id]

    def queue(self, stage: int) -> list[MicroBatch]:
        """Micro-batches at `stage`, in the order they reached it: the first is the one it computes."""
        return [mb for i, mb in self._flight.items() if self._at[i] == stage]

    def next_group(self, decodes: Sequence[Hashable], prefills: Sequence[Hashable]
                   ) -> tuple[list[Hashable], list[Hashable]] | None:
        """The rows the next micro-batch takes, from the rows that could run (`decodes`: decoding,
        `prefills`: with prompt tokens still to go in; each in the order they should go), or None
        when no micro-batch may start (every slot in flight) or none of those rows is free."""
        if not self.free():
            return None
        busy = self.busy()
        ready_d = [r for r in decodes if r not in busy]
        ready_p = [r for r in prefills if r not in busy]
        if not ready_d and not ready_p:
            return None
        take = _share(len(ready_d) + len(ready_p), len(busy), self.stages)
        return ready_d[:take], ready_p[:max(0, take - len(ready_d))]

    def start(self, decodes: Sequence[Hashable], prefills: Sequence[Hashable] = ()) -> MicroBatch:
        """Put a micro-batch of these rows in flight, at stage 0."""
        rows = [*decodes, *prefills]
        if not rows:
            raise ValueError("a micro-batch needs at least one row")
        if len(set(rows)) != len(rows):
            raise ValueError(f"a row goes once in a micro-batch: {rows}")
        if not self.free():
            raise ValueError(f"{self.stages} micro-batches already in flight")
        clash = self.busy().intersection(rows)
        if clash:
            raise ValueError(f"rows {sorted(map(str, clash))} are in flight: their previous step is not done")
        mb = MicroBatch(next(self._ids), tuple(decodes), tuple(prefills))
        self._flight[mb.id] = mb
        self._at[mb.id] = 0
        return mb

    def passed(self, mb_id: int) -> bool:
        """The micro-batch leaves the stage it is at (the first of that stage's queue); True when
        that was the last stage: it is out of flight and its rows may start their next step."""
        if mb_id not in self._flight:
            raise KeyError(f"micro-batch {mb_id} is not in flight")
        stage = self._at[mb_id]
        head = self.queue(stage)[0]
        if head.id != mb_id:
            raise ValueError(f"stage {stage} computes micro-batch {head.id} first (it came before {mb_id})")
        if stage + 1 < self.stages:
            self._at[mb_id] = stage + 1
            # Reaching the next stage after every micro-batch already queued there.
            mb = self._flight.pop(mb_id)
            self._flight[mb_id] = mb
            return False
        del self._flight[mb_id], self._at[mb_id]
        return True

    def drop(self) -> list[MicroBatch]:
        """Every micro-batch out of flight (the pipeline failed mid-step); the ones dropped."""
        dropped = self.in_flight
        self._flight.clear()
        self._at.clear()
        return dropped
