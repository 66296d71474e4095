"""A NATS restart under the gateway (issue 40): tokens sent while the connection was down are
lost. The gateway hands every stream in flight over when the connection comes back (not after
the 60 s token timeout), as a planned move that spends none of the request's hand-overs; a gap
in a token stream is handed over too, not failed."""

import asyncio
from types import SimpleNamespace

from libs.protocol import messages as m
from services.gateway import service as gateway
from services.gateway.routing import ModelRoutes
from services.gateway.workers import InMemoryWorkerClient


class _Tokenizer:
    def decode(self, ids, **_):
        return "".join(chr(ord("a") + t) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(ord("a") + t) for t in ids]


def _event(index: int, token: int, instance: str, finished: bool = False) -> m.TokenEvent:
    return m.TokenEvent(request_id="r", index=index, token_id=token, instance_id=instance, finished=finished,
                        finish_reason="length" if finished else None, prompt_tokens=2)


def _generation(then: list[m.TokenEvent], attempt_after_dispatch: int | None = None):
    """A request streaming from instance "a" (worker w1); a hand-over dispatches it to "a"
    again (the instance did not fail), which sends `then` (recording `attempt_after_dispatch` as
    the request's attempt first, as GatewayService.dispatch does, when given). Returns (gen, the
    gateway, the routes, what was dispatched)."""
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=8)
    routes.add("a", "w1")
    dispatched = []

    async def dispatch(entry, request_id, prompt_ids, sampling, generated_ids=(), choices=None, admitted=False):
        dispatched.append(list(generated_ids))
        route = await routes.acquire(1)
        if attempt_after_dispatch is not None:
            gen.attempt = attempt_after_dispatch
        for ev in then:
            gen.queue.put_nowait(ev)
        return route

    gw = SimpleNamespace(config=gateway.GatewayConfig(first_token_timeout_s=60, token_timeout_s=60),
                         dispatch=dispatch, workers=InMemoryWorkerClient(), streams={})
    entry = SimpleNamespace(info=SimpleNamespace(name="m"), tokenizer=_Tokenizer(), eos_ids=[], routes=routes,
                            ttft_samples=[], tpot_samples=[], tokens_generated=0)
    gen = gateway.Generation(gw, entry, None, "r", [5, 6], m.SamplingSpec(max_tokens=4), [], 0.0,
                             SimpleNamespace(add_event=lambda *a, **k: None, set_attribute=lambda *a: None,
                                             end=lambda: None))
    return gen, gw, routes, dispatched


async def test_a_reconnection_hands_every_stream_over_at_once_as_a_planned_move():
    gen, gw, routes, dispatched = _generation([_event(2, 2, "a"), _event(3, 3, "a", finished=True)])
    gen.route = await routes.acquire(1)
    gw.streams["r"] = gen
    gen.queue.put_nowait(_event(0, 0, "a"))
    gen.queue.put_nowait(_event(1, 1, "a"))
    resyncs = []

    async def resync():
        resyncs.append(True)
    shell = SimpleNamespace(streams=gw.streams, spawn=asyncio.ensure_future, resync=resync)
    pieces = []
    it = gen.__aiter__()
    pieces.append(await it.__anext__())
    pieces.append(await it.__anext__())
    await gateway.GatewayService.on_reconnected(shell)  # NATS is back: tokens 2.. were lost meanwhile
    pieces += [p async for p in it]
    assert dispatched == [[0, 1]]  # resumed from the tokens the client has, at once
    assert "".join(p.text for p in pieces) == "abcd" and pieces[-1].finish_reason == "length"
    assert gen.handovers == 1 and gen.switches == 1  # not the instance's failure: no hand-over spent
    assert gw.workers.cancels == [("w1", m.CancelRequest(request_id="r", instance_id="a"))]
    await asyncio.sleep(0)
    assert resyncs == [True]  # and the registry is read again (routes dropped meanwhile come back)


async def test_a_gap_in_the_token_stream_is_handed_over_not_failed():
    gen, gw, routes, dispatched = _generation([_event(1, 1, "a"), _event(2, 2, "a", finished=True)])
    gen.route = await routes.acquire(1)
    gen.queue.put_nowait(_event(0, 0, "a"))
    gen.queue.put_nowait(_event(2, 2, "a"))  # token 1 was lost on the way
    pieces = [p async for p in gen]
    assert dispatched == [[0]]
    assert "".join(p.text for p in pieces) == "abc" and pieces[-1].finish_reason == "length"


async def test_a_late_token_of_the_attempt_a_request_left_on_the_same_instance_is_dropped():
    """Handed over back to the instance it ran on (attempt 0 -> 1): a token the old attempt had
    already sent arrives after the hand-over, with the very index the new attempt sends next.
    It carries attempt 0 and is dropped; the new attempt's token takes its place."""
    def event(index: int, token: int, attempt: int, finished: bool = False) -> m.TokenEvent:
        return m.TokenEvent(request_id="r", index=index, token_id=token, instance_id="a", attempt=attempt,
                            finished=finished, finish_reason="length" if finished else None, prompt_tokens=2)

    # On the wire after the hand-over: the old attempt's next token, then the new attempt's.
    gen, gw, routes, _ = _generation([event(2, 9, attempt=0), event(2, 2, attempt=1),
                                      event(3, 3, attempt=1, finished=True)], attempt_after_dispatch=1)
    gen.route, gen.attempt = await routes.acquire(1), 0
    gen.queue.put_nowait(event(0, 0, attempt=0))
    gen.queue.put_nowait(event(1, 1, attempt=0))
    gen.queue.put_nowait(m.TokenEvent(request_id="r", index=-1, finished=True, finish_reason="error",
                                      error="the NATS connection was re-established", instance_id="a"))
    pieces = [p async for p in gen]
    assert "".join(p.text for p in pieces) == "abcd" and pieces[-1].finish_reason == "length"
    assert gen.handovers == 1
    assert gw.workers.cancels == [("w1", m.CancelRequest(request_id="r", instance_id="a", attempt=0))]


def test_a_token_event_without_an_attempt_still_parses():
    """Workers from before attempts were echoed send none: the gateway then goes by instance_id."""
    ev = m.TokenEvent.model_validate({"request_id": "r", "index": 0, "token_id": 1, "instance_id": "a"})
    assert ev.attempt is None
