"""Gateway pieces that need no cluster: stop sequences, admission queue."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.errors import APIError
from services.gateway.routing import ModelRoutes
from services.gateway.text import StopMatcher


def deployed_model(checkpoint, name: str = "tiny"):
    """The registry's record of `checkpoint` deployed as `name`, as the gateway receives it."""
    from libs.checkpoint import CheckpointIndex
    from libs.protocol import messages as m

    index = CheckpointIndex.load(checkpoint)
    return m.ModelInfo(name=name, path=str(checkpoint), arch=index.arch, n_layers=index.n_layers,
                       blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum,
                                           layer_start=b.layer_start, layer_end=b.layer_end) for b in index.blocks],
                       state=m.ModelState.deployed, created_at=0.0)

alphabet = st.sampled_from("abc ")


@given(st.lists(st.text(alphabet, max_size=4), max_size=12), st.text(alphabet, min_size=1, max_size=3))
def test_stop_matcher_sends_exactly_the_text_before_the_stop(chunks, stop):
    text = "".join(chunks)
    matcher = StopMatcher([stop])
    sent = "".join(matcher.feed(c) for c in chunks)
    if stop in text:
        assert matcher.stopped and sent == text[:text.index(stop)]
    else:
        assert not matcher.stopped and sent + matcher.flush() == text


async def test_queue_is_bounded_fifo_and_times_out_with_retry_after():
    routes = ModelRoutes("m", max_queue=2, slots_per_instance=1)
    waiters = [asyncio.create_task(routes.acquire(5)) for _ in range(2)]
    await asyncio.sleep(0)
    assert routes.queued == 2
    with pytest.raises(APIError) as full:
        await routes.acquire(5)
    assert full.value.status == 429 and full.value.retry_after
    routes.add("i1", "w1")  # one slot: the first waiter gets it
    first = await waiters[0]
    assert first.instance_id == "i1" and routes.queued == 1
    routes.release(first)
    assert (await waiters[1]).instance_id == "i1"
    with pytest.raises(APIError) as timed_out:
        await routes.acquire(0.05)
    assert timed_out.value.status == 503 and timed_out.value.retry_after


async def test_least_loaded_instance_is_chosen():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4)
    routes.add("a", "w1")
    routes.add("b", "w2")
    got = [(await routes.acquire(1)).instance_id for _ in range(4)]
    assert sorted(got) == ["a", "a", "b", "b"]


async def test_an_instance_still_loading_gets_work_only_once_the_warm_ones_are_saturated():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=2)
    routes.add("loading", "w1", loading=True)
    routes.add("warm", "w2")
    got = [(await routes.acquire(1)).instance_id for _ in range(3)]
    assert got == ["warm", "warm", "loading"]
    routes.add("loading", "w1", loading=False)  # every block in: a route like any other
    assert not routes.routes["loading"].loading



async def test_an_instance_gets_no_more_requests_than_its_engine_runs_at_once():
    """A burst beyond the warm engine's batch waits at the gateway, and goes to new capacity the
    moment it joins, not into the warm engine's own queue."""
    routes = ModelRoutes("m", max_queue=8, slots_per_instance=32)
    routes.add("warm", "w1", max_batch=2)
    waiters = [asyncio.create_task(routes.acquire(5)) for _ in range(4)]
    await asyncio.sleep(0)
    assert routes.routes["warm"].in_flight == 2 and routes.queued == 2
    routes.add("new", "w2", max_batch=3)
    assert [(await w).instance_id for w in waiters] == ["warm", "warm", "new", "new"]
    routes.add("old", "w3")  # an instance that did not say: the gateway's own limit
    assert routes.routes["old"].slots == 32

async def test_a_model_added_from_several_paths_at_once_gets_one_entry(tiny_checkpoint):
    """The deploy call, the model event and the resync can add a model at the same moment:
    they share one entry, so an instance routed through the first is not lost to a second."""
    from services.gateway.service import GatewayService

    info = deployed_model(tiny_checkpoint)
    gateway = GatewayService()
    first = asyncio.create_task(gateway.add_model(info))
    await asyncio.sleep(0)  # the first is reading the tokenizer when an instance becomes ready
    entries = await asyncio.gather(first, gateway.add_model(info), gateway.add_model(info))
    assert entries[0] is entries[1] is entries[2] is gateway.models["tiny"]
    entries[0].routes.add("inst-1", "worker-0")
    again = await gateway.add_model(info.model_copy(update={"max_queue": 7}))
    assert again is entries[0] and again.routes.max_queue == 7 and list(again.routes.routes) == ["inst-1"]


async def test_a_resync_keeps_a_route_whose_ready_event_came_while_the_registry_was_read(tiny_checkpoint,
                                                                                         monkeypatch):
    """An instance's "ready" event reaches the gateway and the registry at once; the registry's
    answer to a resync read before it wrote the event does not list the instance. The route
    stays (a pipeline serves for seconds: dropped, it would get nothing until the next resync);
    a route the registry no longer lists that was there before the read goes."""
    from libs.protocol import messages as m
    from services.gateway import service
    from services.gateway.service import GatewayService

    info = deployed_model(tiny_checkpoint)
    gateway = GatewayService()
    routes = (await gateway.add_model(info)).routes
    routes.add("gone", "worker-0")  # ended while its end event was lost: the resync is what drops it
    pipeline = m.InstanceInfo(instance_id="pipe-1", model="tiny", mode="pipeline", state=m.InstanceState.ready,
                              created_at=0.0, loaded_at=0.0, stages=[m.Stage(worker_id="worker-1", block_start=0,
                                                                              block_end=1),
                                                                     m.Stage(worker_id="worker-2", block_start=1,
                                                                             block_end=2)])

    async def registry_read(broker, subject, request, reply_type, **kwargs):
        # The registry has read its tables (the pipeline still "loading" there) when the
        # pipeline's "ready" event reaches the gateway, before the answer does.
        gateway._apply_instance(pipeline)
        return m.ClusterView(workers=[], models=[info], replicas=[], scale_ops=[],
                             instances=[pipeline.model_copy(update={"state": m.InstanceState.loading})])

    monkeypatch.setattr(service, "call", registry_read)
    await gateway.resync()
    assert list(routes.routes) == ["pipe-1"]
    monkeypatch.setattr(service, "call", lambda *a, **k: asyncio.sleep(0, m.ClusterView(
        workers=[], models=[info], replicas=[], scale_ops=[], instances=[])))
    await gateway.resync()  # a read after the event that does not list it: it has ended
    assert list(routes.routes) == []


async def test_a_model_request_is_503_with_retry_after_until_the_model_can_be_told_to_exist_then_404(tiny_checkpoint):
    """Before the first registry read nothing is known: 503 + Retry-After for any name (a client
    retries that, never a 404). After it, a model whose tokenizer is loading is 503 too; one the
    registry does not list is 404."""
    from services.gateway.service import GatewayService

    info = deployed_model(tiny_checkpoint)
    gateway = GatewayService()

    def refused(name: str) -> APIError:
        with pytest.raises(APIError) as e:
            gateway.entry(name)
        return e.value
    for name in ("tiny", "nope"):
        e = refused(name)
        assert (e.status, e.code) == (503, "gateway_starting") and e.retry_after >= 1
    gateway._mark_synced()  # what the first resync does once it has read the registry
    loading = asyncio.create_task(gateway.add_model(info))
    await asyncio.sleep(0)  # reading the tokenizer
    e = refused("tiny")
    assert (e.status, e.code) == (503, "model_loading") and e.retry_after >= 1
    assert (refused("nope").status, refused("nope").code) == (404, "model_not_found")
    entry = await loading
    assert gateway.entry("tiny") is entry is gateway.models["tiny"]
    hidden = pytest.raises(APIError, gateway.entry, "tiny", visible=False)
    assert hidden.value.status == 404  # a model the key may not use: as one that does not exist
    gateway.listed.add("other")  # the registry lists it, its tokenizer failed to load here
    assert (refused("other").status, refused("other").code) == (503, "model_loading")
    gateway.drop_model("other")  # deleted: it does not exist any more
    assert refused("other").status == 404


async def test_a_request_before_the_first_registry_read_waits_for_it_then_is_refused_503_if_it_does_not_come():
    from services.gateway.service import GatewayConfig, GatewayService

    gateway = GatewayService(GatewayConfig(first_sync_wait_s=600))
    held = asyncio.create_task(gateway.wait_synced())
    await asyncio.sleep(0)
    assert not held.done()  # held, not refused at once
    gateway._mark_synced()
    await asyncio.wait_for(held, 60)  # released by the read (the wait alone is 600 s)

    gateway = GatewayService(GatewayConfig(first_sync_wait_s=0.01))
    await gateway.wait_synced()  # no read came: the wait ends, and the model lookup answers 503
    with pytest.raises(APIError) as e:
        gateway.entry("tiny")
    assert (e.value.status, e.value.code) == (503, "gateway_starting")


async def test_a_resync_read_before_a_deploy_or_a_delete_does_not_undo_it(tiny_checkpoint, monkeypatch):
    """The registry is read every few seconds; a model deployed while a read is under way is not
    in its answer, and one deleted meanwhile still is. The answer must not drop the first (404s
    until the next read, its queued requests failed) nor bring back the second."""
    from libs.protocol import messages as m
    from services.gateway import service
    from services.gateway.service import GatewayService

    old, new = (deployed_model(tiny_checkpoint, name) for name in ("old", "new"))
    gateway = GatewayService()
    await gateway.deployed(old)
    gateway._mark_synced()

    async def registry_read(broker, subject, request, reply_type, **kwargs):
        # The registry has read its tables when the deploy of "new" and the delete of "old" reach the gateway.
        await gateway.deployed(new)
        gateway.deleted("old")
        return m.ClusterView(workers=[], models=[old], replicas=[], scale_ops=[], instances=[])

    monkeypatch.setattr(service, "call", registry_read)
    await gateway.resync()
    assert set(gateway.models) == {"new"} and gateway.listed == {"new"}
    assert gateway.entry("new") is gateway.models["new"]
    with pytest.raises(APIError) as gone:
        gateway.entry("old")
    assert gone.value.status == 404
    # A later read is newer than both: it decides (here the registry lists neither any more).
    monkeypatch.setattr(service, "call", lambda *a, **k: asyncio.sleep(0, m.ClusterView(
        workers=[], models=[], replicas=[], scale_ops=[], instances=[])))
    await gateway.resync()
    assert gateway.models == {} and gateway.listed == set()
