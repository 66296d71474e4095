"""The slot KV cache on the target device: slots are allocated, released and their KV kept apart;
a request with n > 1 forks its prefill's KV into its choices' slots; resize_kv keeps every live
slot's KV (the elastic-KV tests of tests/unit/engine, run on the device)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from libs.engine import Engine, SamplingSpec

sys.path.append(str(Path(__file__).parents[1] / "unit" / "engine"))
from test_engine_kv_resize import REQUESTS, SEQ, _run  # noqa: E402  (the CPU tests' scenario, reused)

pytestmark = pytest.mark.gpu

PROMPT = [1, 17, 200, 45, 301, 99, 7, 450, 12, 64]


def _engine(block_dir, device, slots: int = 8, splits=()) -> Engine:
    return Engine.from_checkpoint(block_dir, device=device, max_batch_size=slots, max_seq_len=SEQ, splits=splits,
                                  eos_token_ids=())


def _drain(engine: Engine) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault((o.request_id, o.choice), []).append(o.token_id)
    return out


def test_slots_are_allocated_released_and_hold_their_requests_kv(block_dir, device):
    engine = _engine(block_dir, device, slots=4)
    stage = engine.stages[0]
    kv = stage.kv
    assert kv.keys[0].device.type == device.type and kv.free_slots == 4
    prompts = {rid: [t + 50 * i for t in PROMPT[:6]] for i, rid in enumerate("abc")}  # same length, one prefill pass
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=3))
    engine.step()  # prefill: each request takes a slot holding its prompt's KV
    slots = {rid: stage._slot[rid] for rid in "abc"}
    assert len(set(slots.values())) == 3 and kv.free_slots == 1
    for slot in slots.values():
        assert kv.lengths[slot] == 6
        assert kv.keys[0][slot, :, :6].abs().sum() > 0  # written on the device
        assert kv.keys[0][slot, :, 6:].abs().sum() == 0  # nothing past what it holds
    a, b = slots["a"], slots["b"]
    assert not torch.equal(kv.keys[0][a, :, :6], kv.keys[0][b, :, :6])  # each slot its own prompt's KV
    assert kv.allocate() is not None and kv.allocate() is None  # the fourth slot, then none
    _drain(engine)
    assert kv.free_slots == 3  # the requests' slots came back; the one taken by hand is still out
    assert stage._slot == {}


def test_choices_fork_the_prefill_kv_and_greedy_choices_equal_n1(block_dir, device):
    alone = _engine(block_dir, device)
    alone.add_request("x", PROMPT, SamplingSpec(temperature=0, max_tokens=8))
    want = _drain(alone)[("x", 0)]
    engine = _engine(block_dir, device)
    stage = engine.stages[0]
    forks: list[tuple[int, int, int]] = []
    copy = stage.kv.copy
    stage.kv.copy = lambda src, dst, length: forks.append((src, dst, length)) or copy(src, dst, length)
    engine.add_request("r", PROMPT, SamplingSpec(temperature=0, max_tokens=8, n=4))
    got: dict[int, list[int]] = {}
    for o in engine.step():  # the prefill, and every choice's first token
        got.setdefault(o.choice, []).append(o.token_id)
    assert len(forks) == 3 and all(length == len(PROMPT) for _, _, length in forks)
    (src,) = {s for s, _, _ in forks}
    assert len({dst for _, dst, _ in forks} | {src}) == 4  # four slots, one per choice
    for _, dst, length in forks:  # every choice's slot starts from the prompt's KV, bit for bit
        for t in (*stage.kv.keys, *stage.kv.values):
            assert torch.equal(t[dst, :, :length], t[src, :, :length])
    for (_, c), toks in _drain(engine).items():
        got[c] += toks
    assert sorted(got) == [0, 1, 2, 3] and all(toks == want for toks in got.values())


@pytest.mark.parametrize("splits", [(), (1,)], ids=["one-stage", "two-stages"])
def test_resize_kv_keeps_the_live_slots(block_dir, device, splits):
    reference = _run(_engine(block_dir, device, splits=splits), {})
    assert set(reference) == {r for r, _, _ in REQUESTS}
    engine = _engine(block_dir, device, splits=splits)
    got = _run(engine, {0: 2, 3: 6, 7: 4, 9: 4, 11: 5, 13: 3})
    assert got == reference
    assert all(t.device.type == device.type for st in engine.stages for t in st.kv.keys)
