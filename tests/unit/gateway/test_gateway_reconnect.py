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


def _generation(then: list[m.TokenEvent]):
    """A request streaming from instance "a" (worker w1); a hand-over dispatches it to "a"
    again (the instance did not fail), which sends `then`. Returns (gen, what was dispatched)."""
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=8)
    routes.add("a", "w1")
    dispatched = []

    async def dispatch(entry, request_id, prompt_ids, sampling, generated_ids=(), choices=None):
        dispatched.append(list(generated_ids))
        route = await routes.acquire(1)
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
