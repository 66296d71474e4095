"""The gateway's side of LLM-Mesh sharing: bin-packing routing (§7.2, CPU first as §4) and
workers' "busy" refusals (shadow validation, §5.3), which keep the route and make the request
try another instance or wait."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from libs.bus.broker import DomainError
from libs.protocol import messages as m
from libs.protocol import subjects
from services.gateway import service as gateway
from services.gateway.errors import APIError
from services.gateway.routing import REFUSAL_HOLD_S, ModelRoutes
from services.gateway.service import GatewayConfig, GatewayService, ModelEntry
from services.gateway.workers import GenerateHandler, InMemoryWorkerClient

# --- routing order --------------------------------------------------------------------------------


async def test_mesh_sends_a_request_to_the_largest_batch_that_still_has_a_free_slot():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4, sharing="mesh")
    for iid in ("small", "big", "full"):
        routes.add(iid, f"w-{iid}")
    routes.routes["small"].in_flight, routes.routes["big"].in_flight, routes.routes["full"].in_flight = 1, 2, 4
    got = [(await routes.acquire(1)).instance_id for _ in range(3)]
    assert got == ["big", "big", "small"]  # "big" fills up, then the next largest; "full" never


async def test_mesh_tries_cpu_instances_before_cuda_ones_and_loading_ones_last():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=2, sharing="mesh")
    routes.add("gpu", "w1", device="cuda")
    routes.add("cpu-loading", "w2", loading=True, device="cpu")
    routes.add("cpu", "w3", device="cpu")
    routes.routes["gpu"].in_flight = 1  # a larger batch does not outweigh the device kind
    got = [(await routes.acquire(1)).instance_id for _ in range(5)]
    assert got == ["cpu", "cpu", "gpu", "cpu-loading", "cpu-loading"]


async def test_exclusive_keeps_least_loaded_first_whatever_the_device():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4)
    routes.add("cpu", "w1", device="cpu")
    routes.add("gpu", "w2", device="cuda")
    routes.routes["cpu"].in_flight = 1
    assert (await routes.acquire(1)).instance_id == "gpu"


@given(st.lists(st.tuples(st.sampled_from(["cpu", "cuda"]), st.booleans(), st.integers(1, 4), st.integers(0, 4)),
                min_size=1, max_size=6))
def test_the_mesh_choice_is_free_and_no_free_route_is_preferred_to_it(specs):
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4, sharing="mesh")
    for k, (device, loading, slots, busy) in enumerate(specs):
        routes.add(f"i{k}", f"w{k}", loading=loading, max_batch=slots, device=device)
        routes.routes[f"i{k}"].in_flight = min(busy, slots)
    free = [r for r in routes.routes.values() if r.in_flight < r.slots]
    if not free:
        return
    before = {r.instance_id: r.in_flight for r in free}
    chosen = asyncio.run(routes.acquire(1))

    def rank(r):  # warm before loading, CPU before CUDA, then the larger batch
        return r.loading, r.device != "cpu", -before[r.instance_id]

    assert chosen.instance_id in before
    assert all(rank(chosen) <= rank(r) for r in free)


def test_sharing_must_be_exclusive_or_mesh():
    with pytest.raises(ValueError, match="sharing must be one of exclusive, mesh, dedicated"):
        ModelRoutes("m", max_queue=1, slots_per_instance=1, sharing="shared")
    with pytest.raises(ValueError, match="got 'spread'"):
        GatewayConfig(sharing="spread")


def test_an_instance_event_carries_its_device_into_the_route():
    gw = GatewayService(GatewayConfig(sharing="mesh"))
    gw.models["m"] = _entry(ModelRoutes("m", max_queue=4, slots_per_instance=4, sharing="mesh"))
    gw._apply_instance(m.InstanceInfo(instance_id="i1", model="m", stages=[m.Stage(worker_id="w1", block_start=0,
                                      block_end=1)], state=m.InstanceState.ready, created_at=0.0, loaded_at=1.0,
                                      device="cuda"))
    assert gw.models["m"].routes.routes["i1"].device == "cuda"


# --- busy refusals ---------------------------------------------------------------------------------


async def test_a_refused_route_stays_but_is_full_at_its_load_until_one_of_its_requests_ends():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("a", "w1")
    running = [await routes.acquire(1) for _ in range(2)]
    routes.refuse(await routes.acquire(1), hold_s=30)  # the third would break an SLO there
    assert "a" in routes.routes and routes.routes["a"].in_flight == 2
    with pytest.raises(APIError) as timed_out:
        await routes.acquire(0.05)  # a has slots, but its worker said no at this load
    assert timed_out.value.status == 503
    routes.add("b", "w2")
    assert (await routes.acquire(1)).instance_id == "b"  # b, though a's batch is larger
    routes.release(running[0])  # one of a's requests ended: one slot there again
    assert (await routes.acquire(1)).instance_id == "a"
    assert (await routes.acquire(1)).instance_id == "b"  # a is at its refused load again


async def test_a_refusal_expires_and_wakes_the_request_waiting_for_it():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("a", "w1")
    routes.refuse(await routes.acquire(1), hold_s=0.1)
    started = time.monotonic()
    assert (await routes.acquire(5)).instance_id == "a"
    assert 0.09 <= time.monotonic() - started < 1


async def test_a_waiter_is_woken_when_a_refused_route_releases_a_request():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("a", "w1")
    first = await routes.acquire(1)
    routes.refuse(await routes.acquire(1), hold_s=30)
    waiter = asyncio.create_task(routes.acquire(5))
    await asyncio.sleep(0.02)
    assert not waiter.done() and routes.queued == 1  # the demand the load-monitor sees
    routes.release(first)
    assert (await asyncio.wait_for(waiter, 1)).instance_id == "a"


async def test_a_refused_request_is_no_new_arrival_and_keeps_its_place_in_a_full_queue():
    routes = ModelRoutes("m", max_queue=1, slots_per_instance=1, sharing="mesh")
    routes.add("a", "w1")
    held = await routes.acquire(1)
    later = asyncio.create_task(routes.acquire(5))  # fills the queue
    await asyncio.sleep(0)
    arrivals = routes.arrivals
    refused = asyncio.create_task(routes.acquire(5, admitted=True))  # admitted before: no 429
    await asyncio.sleep(0)
    assert routes.arrivals == arrivals and routes.queued == 2
    routes.release(held)
    assert (await asyncio.wait_for(refused, 1)).instance_id == "a" and not later.done()
    later.cancel()


# --- dispatch to in-memory workers ----------------------------------------------


def _entry(routes: ModelRoutes, **slos) -> ModelEntry:
    info = m.ModelInfo(name=routes.model, path="/nonexistent", arch="llama", n_layers=1,
                       blocks=[m.BlockInfo(block_id=0, nbytes=1, checksum="x", layer_start=0, layer_end=1)],
                       state=m.ModelState.deployed, created_at=0.0, **slos)
    return ModelEntry(info, tokenizer=None, context_len=64, eos_ids=[], routes=routes, max_prompt_bytes=1024)


def _worker(refusals: int, answer: asyncio.Event | None, stopping: bool) -> GenerateHandler:
    """A worker's generate as a mesh worker's RPC answers it: refusing ("busy") its first
    `refusals` requests; with `answer`, stalled until it is set; `stopping`, as a worker whose
    instance is draining."""
    left = refusals

    async def generate(req: m.GenerateRequest) -> m.GenerateAccepted:
        nonlocal left
        if answer is not None:
            await answer.wait()
        if stopping:
            raise DomainError(f"instance {req.instance_id} is not serving", code="unavailable")
        if left > 0:
            left -= 1
            raise DomainError("taking it would push a request past its TPOT SLO", code="busy")
        return m.GenerateAccepted(request_id=req.request_id)
    return generate


@pytest.fixture
async def gateway_and_workers():
    """A gateway whose workers are in-memory (`InMemoryWorkerClient`: what they are sent is in
    its `received` and `cancels`), those in `stalled` answering only once the test is over."""
    answer = asyncio.Event()

    async def make(sharing: str, refusals: dict[str, int], queue_timeout_s: float = 5.0,
                   stalled: tuple[str, ...] = (), dispatch_timeout_s: float = 5.0, stopping: tuple[str, ...] = ()):
        workers = InMemoryWorkerClient()
        for worker, refused in refusals.items():
            workers.add(worker, _worker(refused, answer if worker in stalled else None, worker in stopping))
        gw = GatewayService(GatewayConfig(sharing=sharing, queue_timeout_s=queue_timeout_s,
                                          dispatch_timeout_s=dispatch_timeout_s), workers=workers)
        return gw, workers

    yield make
    answer.set()


def _refusals(model: str) -> float:
    return REGISTRY.get_sample_value("layercast_gateway_busy_refusals_total", {"model": model}) or 0.0


async def test_dispatch_moves_on_from_a_busy_instance_and_keeps_its_route(gateway_and_workers):
    gw, workers = await gateway_and_workers("mesh", {"w-cpu": 1, "w-gpu": 0})
    routes = ModelRoutes("busy-next", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("cpu", "w-cpu", device="cpu")
    routes.add("gpu", "w-gpu", device="cuda")
    entry = _entry(routes, ttft_slo_s=1.5, tpot_slo_s=0.1)
    before = _refusals("busy-next")
    route = await gw.dispatch(entry, "r1", [1, 2, 3], m.SamplingSpec(max_tokens=4))
    assert route.instance_id == "gpu"
    assert [w for w, _ in workers.received] == ["w-cpu", "w-gpu"]  # CPU first, refused there
    assert "cpu" in routes.routes and routes.routes["cpu"].in_flight == 0  # kept, its slot given back
    assert _refusals("busy-next") == before + 1
    assert all((r.ttft_slo_s, r.tpot_slo_s) == (1.5, 0.1) for _, r in workers.received)


async def test_busy_refusals_are_not_failures_the_request_waits_and_retries(gateway_and_workers):
    """More refusals than dispatch's three attempts, on the only instance: the request waits for
    each refusal to expire and gets in, the route never dropped."""
    gw, workers = await gateway_and_workers("mesh", {"w1": 4})
    routes = ModelRoutes("busy-wait", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("only", "w1")
    route = await gw.dispatch(_entry(routes), "r2", [1, 2, 3], m.SamplingSpec(max_tokens=4))
    assert route.instance_id == "only" and len(workers.received) == 5 and route.in_flight == 1


async def test_each_attempt_tells_the_worker_how_long_the_request_has_waited_so_far(gateway_and_workers):
    """The retries after refusals carry a growing queued_s (a worker stops refusing a request for
    its own lateness once that passes its TTFT SLO): at least a refusal's hold apart."""
    gw, workers = await gateway_and_workers("mesh", {"w1": 2})
    routes = ModelRoutes("busy-waited", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("only", "w1")
    await gw.dispatch(_entry(routes), "r5", [1, 2, 3], m.SamplingSpec(max_tokens=4))
    waited = [r.queued_s for _, r in workers.received]
    assert len(waited) == 3 and waited[0] < REFUSAL_HOLD_S
    assert all(b - a >= REFUSAL_HOLD_S * 0.9 for a, b in zip(waited, waited[1:])), waited


async def test_a_request_refused_everywhere_times_out_with_a_503_and_the_route_stays(gateway_and_workers):
    gw, workers = await gateway_and_workers("mesh", {"w1": 10**6}, queue_timeout_s=0.5)
    routes = ModelRoutes("busy-forever", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("only", "w1")
    started = time.monotonic()
    with pytest.raises(APIError) as e:
        # bounded here: were each refusal to restart the wait, it would never end
        await asyncio.wait_for(gw.dispatch(_entry(routes), "r3", [1], m.SamplingSpec(max_tokens=4)), 3)
    assert e.value.status == 503 and time.monotonic() - started < 2  # within queue_timeout_s, not 3 of them
    assert list(routes.routes) == ["only"] and routes.routes["only"].in_flight == 0


async def test_exclusive_dispatch_carries_the_deployment_slos_too(gateway_and_workers):
    gw, workers = await gateway_and_workers("exclusive", {"w1": 0})
    routes = ModelRoutes("slos", max_queue=4, slots_per_instance=4)
    routes.add("only", "w1")
    await gw.dispatch(_entry(routes, tpot_slo_s=0.05), "r4", [1], m.SamplingSpec(max_tokens=4))
    (_, req), = workers.received
    assert req.ttft_slo_s is None and req.tpot_slo_s == 0.05  # None: the worker's default, max(2, L/512)


async def test_a_dispatch_cancelled_mid_rpc_gives_its_slot_back_and_cancels_on_the_worker(gateway_and_workers):
    """The client went away while the worker's answer was on its way: the slot is not leaked and
    the worker, which may have taken the request, is told to drop it."""
    gw, workers = await gateway_and_workers("exclusive", {"w1": 0}, stalled=("w1",))
    routes = ModelRoutes("gone", max_queue=4, slots_per_instance=2)
    routes.add("only", "w1")
    task = asyncio.create_task(gw.dispatch(_entry(routes), "r5", [1], m.SamplingSpec(max_tokens=4, n=2)))
    for _ in range(100):
        if workers.received:
            break
        await asyncio.sleep(0.02)
    assert workers.received and routes.routes["only"].in_flight == 2  # both choices' slots held mid-RPC
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert routes.routes["only"].in_flight == 0
    for _ in range(100):
        if workers.cancels:
            break
        await asyncio.sleep(0.02)
    assert [(w, c.request_id, c.instance_id) for w, c in workers.cancels] == [("w1", "r5", "only")]


async def test_a_worker_that_does_not_answer_in_time_has_that_attempt_cancelled_and_the_request_goes_on(
        gateway_and_workers):
    """An overloaded worker may take the request after the gateway stopped waiting: the gateway
    cancels that very attempt there (the worker refuses its generate should it come later) and
    tries the next instance; timeouts are not the failures that end a request with a 503."""
    gw, workers = await gateway_and_workers("mesh", {"w-slow": 0, "w-ok": 0}, stalled=("w-slow",),
                                            dispatch_timeout_s=0.3)
    routes = ModelRoutes("unanswered", max_queue=4, slots_per_instance=4, sharing="mesh")
    routes.add("slow", "w-slow", device="cpu")  # tried first (CPU before CUDA)
    routes.add("ok", "w-ok", device="cuda")
    route = await asyncio.wait_for(gw.dispatch(_entry(routes), "r6", [1], m.SamplingSpec(max_tokens=4)), 3)
    assert route.instance_id == "ok"
    (_, late), (_, taken) = workers.received
    assert late.instance_id == "slow" and taken.attempt != late.attempt  # each hand-off its own id
    for _ in range(100):
        if workers.cancels:
            break
        await asyncio.sleep(0.02)
    assert [(w, c.request_id, c.instance_id, c.attempt) for w, c in workers.cancels] == [
        ("w-slow", "r6", "slow", late.attempt)]
    assert "slow" not in routes.routes  # passed over until the next sync with the registry
    assert REGISTRY.get_sample_value("layercast_gateway_unanswered_dispatches_total", {"model": "unanswered"}) == 1


@pytest.mark.parametrize("why", ["stalled", "stopping"])
async def test_timeouts_and_stopping_instances_do_not_fail_a_request_before_its_queue_timeout(
        gateway_and_workers, why):
    """Three unanswered attempts, or three instances that were stopping (drained by a scale-in),
    used to end the request with a 503 ("no instance accepted"): an instance that comes (here:
    added, as a sync does) within the wait takes it."""
    gw, workers = await gateway_and_workers("mesh", {"w-slow": 0, "w-ok": 0}, dispatch_timeout_s=0.2,
                                            queue_timeout_s=10, **{why: ("w-slow",)})
    routes = ModelRoutes(f"unanswered-thrice-{why}", max_queue=4, slots_per_instance=4, sharing="mesh")
    task = asyncio.create_task(gw.dispatch(_entry(routes), "r7", [1], m.SamplingSpec(max_tokens=4)))
    for _ in range(4):
        routes.add("slow", "w-slow")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if "slow" not in routes.routes:
                break
    assert not task.done()
    if why == "stalled":
        assert REGISTRY.get_sample_value("layercast_gateway_unanswered_dispatches_total",
                                         {"model": routes.model}) == 4
    else:
        assert len(workers.received) == 4
    routes.add("ok", "w-ok")
    assert (await asyncio.wait_for(task, 3)).instance_id == "ok"


# --- preemption (§7.1): a worker moves a request out, the gateway hands it over -----------------


class _Letters:
    def decode(self, ids, **_):
        return "".join(chr(ord("a") + t) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(ord("a") + t) for t in ids]


async def _moved_three_times(preempted: bool) -> tuple[str, list[list[int]]]:
    """A request moved out of its instance after each of its first three tokens: the text the
    client gets (or the error it ends with) and the tokens each hand-over resumed from."""
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=8, sharing="mesh")
    for k in range(4):
        routes.add(f"i{k}", f"w{k}")
    resumed: list[list[int]] = []

    def run_on(k: int, tokens: int):
        """Instance i{k}: its next token; moved out after it, or the last one."""
        ev = [m.TokenEvent(request_id="r", index=tokens, token_id=tokens, instance_id=f"i{k}",
                           finished=tokens == 3, finish_reason="length" if tokens == 3 else None)]
        if tokens < 3:
            ev.append(m.TokenEvent(request_id="r", index=tokens + 1, finished=True, finish_reason="error",
                                   error="preempted by instance x", preempted=preempted, instance_id=f"i{k}"))
        for e in ev:
            gen.queue.put_nowait(e)

    async def dispatch(entry, request_id, prompt_ids, sampling, generated_ids=(), choices=None, admitted=False):
        resumed.append(list(generated_ids))
        k = len(resumed)
        run_on(k, len(generated_ids))
        routes.routes[f"i{k}"].in_flight += 1
        return routes.routes[f"i{k}"]

    gw = SimpleNamespace(config=GatewayConfig(first_token_timeout_s=2, token_timeout_s=2), dispatch=dispatch,
                         workers=InMemoryWorkerClient(), streams={})
    entry = SimpleNamespace(info=SimpleNamespace(name="m"), tokenizer=_Letters(), eos_ids=[], routes=routes,
                            ttft_samples=[], tpot_samples=[], tokens_generated=0)
    routes.routes["i0"].in_flight += 1
    gen = gateway.Generation(gw, entry, routes.routes["i0"], "r", [5], m.SamplingSpec(max_tokens=4), [], 0.0,
                             SimpleNamespace(add_event=lambda *a, **k: None, set_attribute=lambda *a: None,
                                             end=lambda: None))
    run_on(0, 0)
    try:
        text = "".join([p.text async for p in gen])
    except APIError as e:
        text = f"{e.status}: {e.message}"
    return text, resumed


async def test_a_preempted_request_is_handed_over_as_often_as_it_is_moved():
    text, resumed = await _moved_three_times(preempted=True)
    assert text == "abcd" and resumed == [[0], [0, 1], [0, 1, 2]]  # one unbroken stream


async def test_three_failures_still_end_a_request():
    # The same events without `preempted` are failures: the third is one too many.
    text, resumed = await _moved_three_times(preempted=False)
    assert text.startswith("503") and len(resumed) == 2
