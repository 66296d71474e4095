"""The planner's kept cluster view (services/planner/views.py): when it is current, when it is
read again. The registry side (counting and announcing changes) is in test_registry.py; the
planner using it end to end is in every scale-out test."""

import asyncio
import time

from libs.protocol import messages as m
from services.planner.views import ClusterViewCache


class Registry:
    """Answers reads with the change count it is at (as RegistryStore.cluster_view does)."""

    def __init__(self, epoch: str = "e1", delay_s: float = 0.0):
        self.epoch, self.changes, self.delay_s, self.reads = epoch, 0, delay_s, 0

    async def read(self) -> m.ClusterView:
        self.reads += 1
        changes = self.changes
        await asyncio.sleep(self.delay_s)
        return m.ClusterView(workers=[], models=[], replicas=[], instances=[], scale_ops=[], epoch=self.epoch,
                             changes=changes)

    def change(self) -> m.ClusterChanged:
        self.changes += 1
        return m.ClusterChanged(epoch=self.epoch, changes=self.changes)


async def test_a_view_is_kept_until_a_newer_change_is_announced():
    reg = Registry()
    views = ClusterViewCache(reg.read)
    assert (await views.get()).changes == 0 and reg.reads == 1
    await views.get()
    assert reg.reads == 1 and views.hits == 1

    views.announced(m.ClusterChanged(epoch="e1", changes=0))  # what the view already holds
    await views.get()
    assert reg.reads == 1

    views.announced(reg.change())
    assert not views.current()
    assert (await views.get()).changes == 1 and reg.reads == 2
    views.announced(m.ClusterChanged(epoch="e1", changes=1))  # late copy of an older count
    await views.get()
    assert reg.reads == 2


async def test_a_change_read_before_its_announcement_arrives_keeps_the_view_current():
    reg = Registry()
    views = ClusterViewCache(reg.read)
    ev = reg.change()  # committed and counted; its announcement is still on its way
    assert (await views.get()).changes == 1
    views.announced(ev)
    assert views.current()


async def test_the_planners_own_marks_and_age_force_a_read():
    reg = Registry()
    views = ClusterViewCache(reg.read, max_age_s=0.2)
    await views.get()
    views.mark_stale()
    await views.get()
    assert reg.reads == 2
    await asyncio.sleep(0.25)
    assert not views.current()
    await views.get()
    assert reg.reads == 3


async def test_a_mark_during_a_read_leaves_that_view_stale():
    reg = Registry(delay_s=0.05)
    views = ClusterViewCache(reg.read)
    reading = asyncio.create_task(views.get())
    await asyncio.sleep(0.01)
    views.mark_stale()  # something happened after the read began: the read may not hold it
    await reading
    assert not views.current()


async def test_another_registry_process_resets_the_count():
    reg = Registry("old")
    views = ClusterViewCache(reg.read)
    await views.get()
    for _ in range(5):
        views.announced(reg.change())
    reg.epoch, reg.changes = "new", 0  # the registry restarted: its count starts again at 0
    assert (await views.get()).epoch == "new"
    assert views.current()  # the old process's announcements say nothing about the new one
    views.announced(reg.change())
    assert not views.current()


async def test_decisions_waiting_together_share_one_read():
    reg = Registry(delay_s=0.05)
    views = ClusterViewCache(reg.read)
    got = await asyncio.gather(*(views.get() for _ in range(5)))
    assert reg.reads == 1 and {v.changes for v in got} == {0}


async def test_keep_current_reads_soon_after_a_change_so_the_next_decision_does_not_wait():
    reg = Registry()
    views = ClusterViewCache(reg.read, settle_s=0.02)
    task = asyncio.create_task(views.keep_current())
    try:
        views.announced(reg.change())
        deadline = time.monotonic() + 2
        while not views.current() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert views.current() and reg.reads == 1
        for _ in range(3):  # a burst of changes is read once, after it settles
            views.announced(reg.change())
        await asyncio.sleep(0.2)
        assert views.current() and reg.reads == 2
        before = views.hits
        assert (await views.get()).changes == 4 and views.hits == before + 1
    finally:
        task.cancel()


async def test_a_failing_read_does_not_stop_keep_current():
    reg = Registry()
    fail = [True]

    async def read() -> m.ClusterView:
        if fail[0]:
            raise TimeoutError("registry away")
        return await reg.read()

    views = ClusterViewCache(read, settle_s=0.01)
    task = asyncio.create_task(views.keep_current())
    try:
        views.mark_stale()
        await asyncio.sleep(0.1)
        assert not views.current()
        fail[0] = False
        views.mark_stale()
        deadline = time.monotonic() + 2
        while not views.current() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert views.current()
    finally:
        task.cancel()
