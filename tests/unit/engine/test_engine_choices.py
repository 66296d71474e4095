"""libs.engine: a request with n choices prefills its prompt once, then decodes each choice as its own row."""

from __future__ import annotations

import conftest_models
import pytest

from libs.engine import AdmissionError, Engine, SamplingSpec

arch, hf_dir, block_dir = conftest_models.arch, conftest_models.hf_dir, conftest_models.block_dir  # fixtures
PROMPT = [1, 17, 200, 45, 301, 99, 7, 450, 12, 64]


def drain(engine: Engine, max_steps: int = 1000) -> dict[tuple[str, int], list]:
    """Step until idle; outputs grouped by (request id, choice)."""
    out: dict[tuple[str, int], list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for o in engine.step():
            out.setdefault((o.request_id, o.choice), []).append(o)
    raise AssertionError("engine did not finish")


def tokens(out, rid: str = "r") -> dict[int, list[int]]:
    return {c: [o.token_id for o in outs] for (r, c), outs in sorted(out.items()) if r == rid}


def count_prefill(engine: Engine) -> list[int]:
    """Tokens of every prefill pass (more than one token a row) through each stage, recorded."""
    counted = [0] * len(engine.stages)
    for i, stage in enumerate(engine.stages):
        forward = stage.forward

        def wrapped(ids, inputs, q_len, logits_to_keep=0, _i=i, _forward=forward):
            if q_len > 1:
                counted[_i] += len(ids) * q_len
            return _forward(ids, inputs, q_len, logits_to_keep)

        stage.forward = wrapped
    return counted


def solo(block_dir, params: SamplingSpec, outputs: bool = False, **kw):
    engine = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64, eos_token_ids=(), **kw)
    engine.add_request("x", PROMPT, params)
    out = drain(engine)
    return out[("x", 0)] if outputs else tokens(out, "x")[0]


@pytest.mark.parametrize("splits", [(), (1,)])
def test_the_prompt_is_prefilled_once_and_greedy_choices_equal_n1(block_dir, splits):
    """n=4 through one stage or a two-stage pipeline: each stage sees the prompt's tokens once
    (not 4 times), every choice's first token comes in the prefill's step, and greedy choices
    all equal the n=1 output."""
    want = solo(block_dir, SamplingSpec(temperature=0, max_tokens=8))
    engine = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64, eos_token_ids=(), splits=splits)
    prefilled = count_prefill(engine)
    engine.add_request("r", PROMPT, SamplingSpec(temperature=0, max_tokens=8, n=4))
    first = engine.step()
    assert sorted(o.choice for o in first) == [0, 1, 2, 3]
    assert prefilled == [len(PROMPT)] * len(engine.stages)
    out = drain(engine)
    got = tokens(out)
    assert {c: [o.token_id for o in first if o.choice == c] + got[c] for c in got} == {c: want for c in range(4)}
    assert all(out[("r", c)][-1].finished and out[("r", c)][-1].finish_reason == "length" for c in range(4))
    assert all(o.completion_tokens == 8 for c in range(4) for o in out[("r", c)][-1:])
    assert prefilled == [len(PROMPT)] * len(engine.stages)  # decodes are one token a row
    assert engine.free_slots == engine.max_batch_size


@pytest.mark.parametrize("splits", [(), (1,)])
def test_seeded_choices_differ_are_reproducible_and_each_samples_as_seed_plus_i(block_dir, splits):
    """Choice i of a seeded request samples as an n=1 request with seed + i: reproducible,
    different from its siblings, and proof that each fork's KV equals the prompt's own
    (one stage or two): the same tokens, and the same logprobs (the model's, so any difference
    in a choice's KV shows)."""
    params = SamplingSpec(temperature=1.0, max_tokens=12, seed=7, n=3, logprobs=0)

    def run() -> dict:
        engine = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64, eos_token_ids=(), splits=splits)
        engine.add_request("r", PROMPT, params)
        return drain(engine)

    out = run()
    got = tokens(out)
    assert got == tokens(run())
    assert len({tuple(t) for t in got.values()}) == 3
    for c in range(3):
        alone = solo(block_dir, SamplingSpec(temperature=1.0, max_tokens=12, seed=7 + c, logprobs=0), outputs=True)
        assert got[c] == [o.token_id for o in alone]
        assert [o.logprob for o in out[("r", c)]] == pytest.approx([o.logprob for o in alone], abs=1e-5)


def test_choices_take_slots_together_and_cancel_together(block_dir):
    engine = Engine.from_checkpoint(block_dir, max_batch_size=4, max_seq_len=64, eos_token_ids=(), max_queue=4)
    with pytest.raises(AdmissionError, match="n=5"):
        engine.add_request("big", PROMPT, SamplingSpec(max_tokens=4, n=5))
    engine.add_request("one", PROMPT, SamplingSpec(temperature=0, max_tokens=3))
    engine.add_request("four", PROMPT, SamplingSpec(temperature=0, max_tokens=3, n=4))
    assert engine.num_requests == 5
    with pytest.raises(AdmissionError, match="full"):
        engine.add_request("more", PROMPT, SamplingSpec(max_tokens=3, n=4))  # 9 choices > 4 + 4
    steps = []
    while engine.has_work():
        steps.append({(o.request_id, o.choice) for o in engine.step()})
    # "four" waits until "one" has freed its slot, then all its choices start in one step.
    started = next(i for i, s in enumerate(steps) if ("four", 0) in s)
    assert started >= 3 and {("four", c) for c in range(4)} <= steps[started]

    engine.add_request("gone", PROMPT, SamplingSpec(temperature=0, max_tokens=10, n=3))
    engine.step()
    assert engine.free_slots == 1
    assert engine.cancel("gone") and not engine.cancel("gone")
    assert engine.free_slots == 4 and not engine.has_work()


def test_a_handed_over_request_resumes_its_unfinished_choices(block_dir):
    """Hand-over with n>1: the choices still running, each with its tokens so far; the prompt is
    still prefilled once (each choice's own tokens after the copy), and each goes on where it was."""
    want = solo(block_dir, SamplingSpec(temperature=0, max_tokens=8))
    engine = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64, eos_token_ids=())
    prefilled = count_prefill(engine)
    engine.add_request("r", PROMPT, SamplingSpec(temperature=0, max_tokens=8, n=4),
                       choices={1: want[:3], 2: [], 3: want[:5]})
    got = tokens(drain(engine))
    assert got == {1: want[3:], 2: want, 3: want[5:]}
    # The prompt once, then choice 1's two and choice 3's four tokens before their last one.
    assert prefilled == [len(PROMPT) + 2 + 4]
    with pytest.raises(ValueError, match="choices"):
        engine.add_request("bad", PROMPT, SamplingSpec(n=2), choices={2: []})
