"""The planner's copy of the registry's cluster view, kept between scale decisions.

A scale-out's decision -> first byte is its latency, and a registry round trip under load is
a large part of it. So the planner keeps the last ClusterView and uses
it while it is current: the registry counts every committed change to workers, models,
replicas and instances and announces the count (ClusterChanged); a view read when the count
was n holds at least n changes, so it is current until a higher count arrives. The planner
also marks it stale itself on the events it acts on (a deploy, an instance event, a worker's
loss) and after its own scale operations, since the announcement of those may come later than
the next decision. A view older than max_age_s is read again whatever was announced (a lost
event must not keep a stale view forever)."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from libs.protocol import messages as m

log = logging.getLogger(__name__)


class ClusterViewCache:
    def __init__(self, read: Callable[[], Awaitable[m.ClusterView]], max_age_s: float = 10.0,
                 settle_s: float = 0.1):
        self._read = read
        self.max_age_s = max_age_s
        self.settle_s = settle_s  # a burst of changes is read once, after it
        self._view: m.ClusterView | None = None
        self._read_at = 0.0  # time.monotonic() when the read started
        self._announced: tuple[str, int] | None = None  # the newest (epoch, changes) announced
        self._stale_marks = 0  # marks by the planner itself
        self._view_marks = -1  # marks already seen when the view was read
        self._lock = asyncio.Lock()  # one read at a time; a decision waiting on it gets that read
        self._wake = asyncio.Event()
        self.hits = 0  # decisions answered from the kept view

    def announced(self, ev: m.ClusterChanged) -> None:
        latest = self._announced
        if latest is None or latest[0] != ev.epoch or ev.changes > latest[1]:
            self._announced = (ev.epoch, ev.changes)
        if not self.current():
            self._wake.set()

    def mark_stale(self) -> None:
        self._stale_marks += 1
        self._wake.set()

    def age_s(self) -> float:
        return time.monotonic() - self._read_at if self._view is not None else float("inf")

    def current(self) -> bool:
        view = self._view
        if view is None or self._view_marks != self._stale_marks or self.age_s() > self.max_age_s:
            return False
        return self._announced is None or (self._announced[0] == view.epoch and self._announced[1] <= view.changes)

    async def get(self) -> m.ClusterView:
        """The current view: the kept one, or a fresh read."""
        if self.current():
            self.hits += 1
            return self._view
        return await self.refresh(only_if_stale=True)

    async def refresh(self, only_if_stale: bool = False) -> m.ClusterView:
        async with self._lock:
            if only_if_stale and self.current():  # a read that finished while this one waited
                self.hits += 1
                return self._view
            marks, started = self._stale_marks, time.monotonic()
            view = await self._read()
            self._view, self._read_at, self._view_marks = view, started, marks
            if self._announced is not None and self._announced[0] != view.epoch:
                self._announced = None  # another registry process counted those: this view is its newest word
            return view

    async def keep_current(self) -> None:
        """Background: read again soon after a change (and before the view ages out), so that a
        scale decision seldom waits for the registry."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.max_age_s / 2)
            except TimeoutError:
                pass
            self._wake.clear()
            await asyncio.sleep(self.settle_s)
            if self.current() and self.age_s() < self.max_age_s / 2:
                continue
            try:
                await self.refresh()
            except Exception as e:  # the registry is away: decisions read it themselves meanwhile
                log.warning("reading the cluster view failed: %s", e)
