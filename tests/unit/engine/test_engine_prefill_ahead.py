"""Execute while loading inside one instance (Engine.prefill_ahead): while a serve-while-loading
instance's blocks arrive, its waiting prefills run through the blocks that have landed, never
waiting for one; the step once every block is in runs only the rest. The tokens are the
engine's over loaded blocks, whatever happens meanwhile (a cancel, a KV resize, a block that
fails to arrive)."""

from __future__ import annotations

import pytest
import torch
from conftest_models import N_BLOCKS, arch, block_dir, drain_tokens, hf_dir, load_all  # noqa: F401  (fixtures)

from libs.engine import Engine, SamplingSpec

# Prompts of different lengths: run ahead, they go as one pass per length.
PROMPTS = {"long": list(range(3, 40)), "short": [5, 6, 7], "mid": [1, 17, 200, 45, 301, 99, 7, 450]}
GREEDY = SamplingSpec(temperature=0, max_tokens=6)


class _Landing:
    """Blocks that land when the test says (a load's BlockSource, with `ready`); a wait for a
    block not landed is a test failure: prefill_ahead must never wait."""

    def __init__(self, blocks: dict[int, torch.Tensor], fail: int | None = None):
        self.blocks, self.fail, self.landed = blocks, fail, set()

    def ready(self, b: int) -> bool:
        return b in self.landed

    def wait(self, b: int, timeout=None) -> torch.Tensor:
        assert b in self.landed, f"waited for block {b}, which had not landed"
        if b == self.fail:
            raise ValueError(f"block {b}: checksum mismatch")
        return self.blocks[b]


@pytest.fixture
def loaded(block_dir):  # noqa: F811
    return load_all(block_dir)


@pytest.fixture
def alone(loaded) -> dict[str, list[int]]:
    """Every prompt's greedy tokens from an engine over loaded blocks."""
    index, blocks = loaded
    engine = Engine(index, blocks, device="cpu", max_batch_size=4, max_seq_len=128)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    return drain_tokens(engine)


def landing_engine(loaded, fail: int | None = None) -> tuple[Engine, _Landing]:
    index, blocks = loaded
    source = _Landing(blocks, fail)
    engine = Engine(index, source, device="cpu", max_batch_size=4, max_seq_len=128)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    return engine, source


def run_ahead(engine: Engine) -> int:
    """Call prefill_ahead until it has nothing to run, as the worker's engine thread does: the passes it ran."""
    calls = 0
    while engine.prefill_ahead():
        calls += 1
    return calls


def test_waiting_prefills_run_through_each_landed_block_and_give_the_loaded_engines_tokens(loaded, alone):
    engine, source = landing_engine(loaded)
    assert not engine.prefill_ahead()  # nothing landed: nothing to run, nothing waited for
    for b in range(N_BLOCKS - 1):
        source.landed.add(b)
        assert engine.prefill_ahead() and engine.ahead_blocks == b + 1  # the first admitted pass first
        assert run_ahead(engine) == len(PROMPTS) - 1  # then the others (one per length), one a call
        assert engine.ahead_blocks == b + 1  # blocks run ahead, not passes
        assert engine.has_work() and not engine.runnable()
    # Every block but the last has run for every prompt before the last one lands.
    assert engine.ahead_blocks == N_BLOCKS - 1
    source.landed.add(N_BLOCKS - 1)
    assert engine.runnable() and not engine.prefill_ahead()  # a runnable engine is stepped instead
    # The step runs only the last block's layers of the passes run ahead, each prompt whole (one
    # pass per length; nothing decodes while the model loads, so no chunks): every prompt is in
    # and gives its first token.
    first = engine.step()
    assert sorted(o.request_id for o in first) == sorted(PROMPTS)
    assert engine.last_step is None  # part of a prefill: not a sample of the step-time profile
    assert drain_tokens(engine, {o.request_id: [o.token_id] for o in first}) == alone


def test_a_request_cancelled_meanwhile_leaves_the_others_tokens_unchanged(loaded, alone):
    engine, source = landing_engine(loaded)
    source.landed.add(0)
    assert run_ahead(engine)
    assert engine.cancel("mid")
    assert engine.free_slots == engine.max_batch_size - 2  # its slot is free again
    source.landed.update(range(N_BLOCKS))
    got = drain_tokens(engine)
    assert got == {rid: alone[rid] for rid in ("long", "short")}


def test_a_kv_resize_meanwhile_runs_the_prefills_again_with_the_same_tokens(loaded, alone):
    engine, source = landing_engine(loaded)
    source.landed.add(0)
    assert run_ahead(engine)
    engine.resize_kv(6)  # slots move: the KV written ahead would not follow, so it is run again
    source.landed.update(range(N_BLOCKS))
    assert drain_tokens(engine) == alone


def test_a_block_that_fails_to_load_stops_running_ahead_and_fails_the_step_as_before(loaded):
    engine, source = landing_engine(loaded, fail=1)
    source.landed.update({0, 1})
    assert not engine.prefill_ahead()  # block 1's checksum fails: nothing more runs ahead
    assert engine.ahead_blocks == 0 and not engine.prefill_ahead()
    source.landed.add(2)
    with pytest.raises(ValueError, match="checksum"):
        engine.step()


def test_a_request_that_arrives_after_the_first_blocks_ran_catches_up_through_them(loaded, alone):
    index, blocks = loaded
    source = _Landing(blocks)
    engine = Engine(index, source, device="cpu", max_batch_size=4, max_seq_len=128)
    engine.add_request("long", PROMPTS["long"], GREEDY)
    source.landed.add(0)
    assert engine.prefill_ahead()
    engine.add_request("short", PROMPTS["short"], GREEDY)
    assert engine.prefill_ahead()  # no new block: the late request's own pass runs block 0
    assert not engine.prefill_ahead()
    source.landed.update(range(N_BLOCKS))
    first = engine.step()  # both passes' last block: each prompt (alone in its pass) is in
    assert [o.request_id for o in first] == ["long", "short"]
    got = drain_tokens(engine, {o.request_id: [o.token_id] for o in first})
    assert got == {rid: alone[rid] for rid in ("long", "short")}


def test_rows_beyond_the_ahead_limit_wait_for_the_steps_after_the_load(loaded, alone, monkeypatch):
    import libs.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "AHEAD_TOKEN_LIMIT", 40)  # in order: long (37) and short (3) fit, mid not
    engine, source = landing_engine(loaded)
    source.landed.add(0)
    assert run_ahead(engine) == 2
    source.landed.update(range(N_BLOCKS))
    first = engine.step()  # only the passes run ahead
    assert sorted(o.request_id for o in first) == ["long", "short"]
    assert drain_tokens(engine, {o.request_id: [o.token_id] for o in first}) == alone


def test_the_steps_after_the_load_finish_the_passes_run_ahead_a_budget_at_a_time_first_admitted_first(
        loaded, alone):
    """Once every block is in, a step finishes only the passes that fit its token budget (each
    counting its tokens times the layers it has left): the first admitted prompt's token comes
    after its own remaining compute, not the whole batch's (libs.planning.ahead)."""
    index, blocks = loaded
    source = _Landing(blocks)
    # 8 tokens a step: "long" (37 tokens, a third of its layers left: 12.3) goes alone, then
    # "short" and "mid" (1 and 2.7) fit beside long's decode.
    engine = Engine(index, source, device="cpu", max_batch_size=4, max_seq_len=128, token_budget=8)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    source.landed.update(range(N_BLOCKS - 1))
    assert run_ahead(engine) and engine.ahead_blocks == N_BLOCKS - 1
    source.landed.add(N_BLOCKS - 1)
    first = engine.step()
    assert [o.request_id for o in first] == ["long"]
    second = engine.step()
    assert sorted(o.request_id for o in second) == ["long", "mid", "short"]  # long's decode, the others' first
    tokens = {o.request_id: [o.token_id] for o in first}
    for o in second:
        tokens.setdefault(o.request_id, []).append(o.token_id)
    assert drain_tokens(engine, tokens) == alone
