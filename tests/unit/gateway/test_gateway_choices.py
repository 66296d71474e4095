"""Gateway, n > 1 without a cluster: slots per choice, and a Generation's choices through a hand-over."""

import asyncio
from types import SimpleNamespace

from services.gateway import service as gateway
from services.gateway.routing import ModelRoutes
from services.gateway.workers import InMemoryWorkerClient
from libs.protocol import messages as m


async def test_a_request_takes_a_slot_per_choice_and_waits_for_all_of_them():
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=32)
    routes.add("a", "w1", max_batch=4)
    one = await routes.acquire(1)
    assert one.in_flight == 1
    three = await routes.acquire(1, weight=3)
    assert three.in_flight == 4
    waiting = asyncio.create_task(routes.acquire(5, weight=2))
    behind = asyncio.create_task(routes.acquire(5))  # first come, first served: waits behind it
    await asyncio.sleep(0)
    assert routes.queued == 2
    routes.release(one)
    await asyncio.sleep(0)
    assert not waiting.done() and not behind.done()  # one free slot: not enough for 2 choices
    routes.release(three, 3)
    assert (await waiting).in_flight == 3 and (await behind).in_flight == 3
    # More choices than an instance has: the whole instance (its worker says whether it can).
    routes.release(three, 2)
    routes.release(three)
    assert routes.routes["a"].in_flight == 0
    big = await routes.acquire(1, weight=9)
    assert big.in_flight == 4
    routes.release(big, 9)
    assert big.in_flight == 0


class _Tokenizer:
    """Token t is the character chr(ord('a') + t)."""

    def decode(self, ids, **_):
        return "".join(chr(ord("a") + t) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(ord("a") + t) for t in ids]


def _event(choice: int, index: int, token: int | None, instance: str, finished: bool = False,
           error: str | None = None) -> m.TokenEvent:
    return m.TokenEvent(request_id="r", index=index, token_id=token, choice=choice, instance_id=instance,
                        finished=finished, finish_reason=("error" if error else "length") if finished else None,
                        error=error, prompt_tokens=2)


async def test_a_hand_over_resumes_the_unfinished_choices_from_their_own_tokens():
    """Choice 1 ended, choice 0 had 2 tokens when its instance failed: the hand-over asks the
    next instance for choice 0 only, from its 2 tokens, as a request admitted before (at the
    queue's head: a pipeline's switch hands over requests that came before those queued); the
    client sees each choice's tokens once (a late token of the old instance is dropped), usage
    sums the choices."""
    routes = ModelRoutes("m", max_queue=4, slots_per_instance=8)
    routes.add("old", "w1")
    dispatched = []

    async def dispatch(entry, request_id, prompt_ids, sampling, generated_ids=(), choices=None, admitted=False):
        dispatched.append((list(generated_ids), choices, admitted))
        routes.routes["new"].in_flight += 2
        # What comes next: choice 0 from its third token (an index sent again is dropped), and a
        # late token of the old instance (dropped).
        for ev in [_event(0, 1, 2, "new"), _event(0, 2, 1, "old"), _event(0, 2, 0, "new"),
                   _event(0, 3, 3, "new", finished=True)]:
            gen.queue.put_nowait(ev)
        return routes.routes["new"]

    workers = InMemoryWorkerClient()
    gw = SimpleNamespace(config=gateway.GatewayConfig(first_token_timeout_s=2, token_timeout_s=2), dispatch=dispatch,
                         workers=workers, streams={})
    entry = SimpleNamespace(info=SimpleNamespace(name="m"), tokenizer=_Tokenizer(), eos_ids=[], routes=routes,
                            ttft_samples=[], tpot_samples=[], tokens_generated=0)
    old = await routes.acquire(1, weight=2)
    routes.add("new", "w2")
    gen = gateway.Generation(gw, entry, old, "r", [5, 6], m.SamplingSpec(n=2, max_tokens=4), [], 0.0,
                             SimpleNamespace(add_event=lambda *a, **k: None, set_attribute=lambda *a: None,
                                             end=lambda: None))
    for ev in [_event(0, 0, 0, "old"), _event(1, 0, 1, "old"), _event(0, 1, 2, "old"),
               _event(1, 1, 3, "old", finished=True), _event(0, 0, None, "old", finished=True, error="it died")]:
        gen.queue.put_nowait(ev)
    pieces = [p async for p in gen]
    # Admitted before: it waits at the queue's head, ahead of requests that came after it.
    assert dispatched == [([], {0: [0, 2]}, True)]
    assert workers.cancels == [("w1", m.CancelRequest(request_id="r", instance_id="old"))]  # the old one stops
    assert gen.route.instance_id == "new"
    text = {i: "".join(p.text for p in pieces if p.index == i) for i in (0, 1)}
    assert text == {0: "acad", 1: "bd"}
    assert [(p.index, p.finish_reason) for p in pieces if p.finish_reason] == [(1, "length"), (0, "length")]
    assert gen.completion_tokens == 6 and pieces[-1].completion_tokens == 6
    # The load-monitor's report: each token streamed counts once (not the dropped repeats), and
    # the finished request gives one TPOT sample.
    assert entry.tokens_generated == 6 and len(entry.tpot_samples) == 1 and len(entry.ttft_samples) == 1
    await gen.close()
    assert routes.routes["old"].in_flight == 0 and routes.routes["new"].in_flight == 0
