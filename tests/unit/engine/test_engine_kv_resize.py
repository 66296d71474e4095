"""libs.engine elastic KV (LLM-Mesh §6.2): resizing an engine's KV cache keeps its running requests'
KV, so their greedy tokens are those of an engine never resized; a resize below the slots in use
is refused and changes nothing; a multi-stage engine resizes every stage or none."""

from __future__ import annotations

import conftest_models
import pytest
import torch
from transformers import LlamaConfig

from libs.engine import Engine, SamplingSpec, kv_slot_bytes_of
from libs.engine.kv import SlotKVCache, kv_bytes_per_slot

arch, hf_dir, block_dir = conftest_models.arch, conftest_models.hf_dir, conftest_models.block_dir  # fixtures

SEQ = 64
# (request id, prompt, max_tokens): different lengths, so requests end at different steps and
# the live slots are not contiguous when the cache shrinks.
REQUESTS = [("a", [1, 17, 200, 45], 5), ("b", [9, 10, 11, 12, 13, 14], 14), ("c", [19, 20, 21], 9),
            ("d", [30, 31, 32, 33, 34], 12), ("e", [40, 41], 16)]


def _step(engine: Engine, out: dict[str, list[int]]) -> None:
    for o in engine.step():
        out.setdefault(o.request_id, []).append(o.token_id)


def _run(engine: Engine, resizes: dict[int, int]) -> dict[str, list[int]]:
    """a and b at once, c, d and e after 3 steps; before step k, resize to `resizes[k]` slots."""
    out: dict[str, list[int]] = {}
    for k in range(60):
        if k == 0:
            for rid, prompt, n in REQUESTS[:2]:
                engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n))
        if k == 3:
            for rid, prompt, n in REQUESTS[2:]:
                engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n))
        if k in resizes:
            engine.resize_kv(resizes[k])
            assert engine.kv_slots == engine.max_batch_size == resizes[k]
        if not engine.has_work():
            return out
        _step(engine, out)
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module", params=[(), (1,)], ids=["one-stage", "two-stages"])
def splits(request) -> tuple[int, ...]:
    return request.param


def _engine(block_dir, splits) -> Engine:
    return Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=SEQ, splits=splits)


@pytest.fixture(scope="module")
def reference(block_dir, splits) -> dict[str, list[int]]:
    return _run(_engine(block_dir, splits), {})


def test_resizing_up_and_down_keeps_running_requests_tokens(block_dir, splits, reference):
    assert set(reference) == {r for r, _, _ in REQUESTS}
    # Start small, grow before the second wave joins, then shrink twice while requests run
    # (a ends at step 5: the slots still live are renumbered), and grow again.
    got = _run(_engine(block_dir, splits), {0: 2, 3: 6, 7: 4, 9: 4, 11: 5, 13: 3})
    assert got == reference


def test_a_resize_below_the_slots_in_use_is_refused_and_changes_nothing(block_dir, splits, reference):
    engine = _engine(block_dir, splits)
    out: dict[str, list[int]] = {}
    for rid, prompt, n in REQUESTS:
        engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n))
    _step(engine, out)
    caches = [st.kv for st in engine.stages]
    pools = [list(c.keys) for c in caches]
    with pytest.raises(ValueError, match="in use"):
        engine.resize_kv(4)  # five run
    with pytest.raises(ValueError):
        engine.resize_kv(0)
    assert engine.kv_slots == engine.max_batch_size == 8
    assert [list(c.keys) for c in caches] == pools  # the very same tensors
    while engine.has_work():
        _step(engine, out)
    # Their tokens as if started together on an engine never resized.
    alone = _engine(block_dir, splits)
    for rid, prompt, n in REQUESTS:
        alone.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n))
    ref: dict[str, list[int]] = {}
    while alone.has_work():
        _step(alone, ref)
    assert out == ref


def test_a_multi_stage_engine_resizes_every_stage_or_none(block_dir):
    reference = _run(_engine(block_dir, (1,)), {})
    engine = _engine(block_dir, (1,))
    assert len(engine.stages) == 2
    out: dict[str, list[int]] = {}
    for rid, prompt, n in REQUESTS[:2]:
        engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n))
    for _ in range(3):
        _step(engine, out)
    second = engine.stages[1]

    def fails(slots):
        raise MemoryError("no memory for the new pool")

    second.resize = fails
    with pytest.raises(MemoryError):
        engine.resize_kv(6)
    assert [st.slots for st in engine.stages] == [8, 8]  # the first stage went back
    assert engine.max_batch_size == 8
    del second.resize  # the stage's own method again
    engine.resize_kv(5)
    assert [st.slots for st in engine.stages] == [5, 5]
    for rid, prompt, n in REQUESTS[2:]:
        engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n))
    while engine.has_work():
        _step(engine, out)
    assert out == reference


def test_an_engine_with_a_remote_stage_is_not_resized(block_dir):
    local = _engine(block_dir, (1,))

    class Remote:  # what the engine knows of a RemoteStage
        slots = 8

        def submit(self, *args):
            raise AssertionError("not called")

    engine = Engine(local.index, stages=[local.stages[0], Remote()], max_batch_size=8, max_seq_len=SEQ)
    with pytest.raises(ValueError, match="remote"):
        engine.resize_kv(4)
    assert engine.stages[0].slots == 8


def test_slot_bytes_and_slots_of_an_engine(block_dir, splits):
    engine = _engine(block_dir, splits)
    config = engine.model.config
    per_slot = kv_bytes_per_slot(config, config.num_hidden_layers, SEQ, engine.model.dtype)
    assert engine.kv_slots == 8 and engine.kv_slot_bytes == per_slot
    assert kv_slot_bytes_of(engine.index, SEQ) == per_slot  # known before building (a worker charges it)
    engine.resize_kv(3)
    assert engine.kv_slot_bytes == per_slot
    assert sum(st.kv.nbytes for st in engine.stages) == 3 * per_slot


def test_a_cache_resize_copies_each_live_slot_and_renumbers_them_in_order():
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2)
    cache = SlotKVCache(config, 0, 2, slots=4, max_seq_len=8, device=torch.device("cpu"), dtype=torch.float32)
    slots = [cache.allocate() for _ in range(4)]
    for s in slots:
        for t in (*cache.keys, *cache.values):
            t[s, :, : s + 1] = float(s + 1)
        cache.lengths[s] = s + 1
    cache.release(0)
    cache.release(2)
    moved = cache.resize(2)
    assert moved == {1: 0, 3: 1}
    assert cache.slots == 2 and cache.free_slots == 0 and cache.lengths == [2, 4]
    for t in (*cache.keys, *cache.values):
        assert t.shape[0] == 2
        assert torch.equal(t[0, :, :2], torch.full_like(t[0, :, :2], 2.0)) and float(t[0, :, 2:].abs().sum()) == 0
        assert torch.equal(t[1, :, :4], torch.full_like(t[1, :, :4], 4.0)) and float(t[1, :, 4:].abs().sum()) == 0
    with pytest.raises(ValueError, match="in use"):
        cache.resize(1)
    cache.resize(5)
    assert cache.free_slots == 3 and cache.allocate() == 2  # new slots after the live ones
