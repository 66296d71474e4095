"""libs.engine sampling: penalties (OpenAI presence/frequency, HF/vLLM repetition) and logprobs,
checked against Hugging Face on the same checkpoint and against the definitions computed by hand."""

from __future__ import annotations

import pytest
import torch
from conftest_models import arch, block_dir, hf_dir, reference_model  # noqa: F401  (fixtures)
from test_engine import drain

from libs.engine import Engine, SamplingSpec, apply_penalties, sample_token, token_logprobs

PROMPT = [1, 17, 200, 45, 301, 99, 7, 450, 12, 64]
OTHER = [300, 2, 9, 44, 81, 7, 120]


@pytest.fixture(scope="module")
def ref(hf_dir):
    return reference_model(hf_dir)


@pytest.fixture(scope="module")
def engine(block_dir):
    return Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=256, eos_token_ids=())




def hf_step_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: the logits HF gives for each generated token's position (one
    forward pass over prompt + generated, no cache)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(generated)]


def by_hand(logits: list[float], prompt: list[int], output: list[int], presence=0.0, frequency=0.0,
            repetition=1.0) -> list[float]:
    """The definitions, one token at a time (vLLM's order: repetition, then frequency and presence)."""
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(t)
        out.append(x - frequency * count - presence * (count > 0))
    return out


# -- the definitions --------------------------------------------------------------------------


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.25])
    prompt, output = [0, 4], [3, 3, 2]
    for kw in (dict(presence=0.5), dict(frequency=0.7), dict(repetition=1.5), dict(repetition=0.8),
               dict(presence=-1.0, frequency=2.0, repetition=1.3)):
        params = SamplingSpec(presence_penalty=kw.get("presence", 0.0), frequency_penalty=kw.get("frequency", 0.0),
                                repetition_penalty=kw.get("repetition", 1.0))
        got = apply_penalties(logits, params, prompt, output)
        assert got.tolist() == pytest.approx(by_hand(logits.tolist(), prompt, output, **kw), abs=1e-6), kw
    # Written out once: presence 0.5, frequency 0.7, repetition 2 over prompt [0, 4] and output [3, 3, 2].
    params = SamplingSpec(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=2.0)
    assert apply_penalties(logits, params, prompt, output).tolist() == pytest.approx(
        [1.0, -1.0, 0.25 - 0.7 - 0.5, 1.5 - 1.4 - 0.5, -4.0, 0.25])
    # No penalties: the logits untouched (no copy, no cost).
    assert apply_penalties(logits, SamplingSpec(), prompt, output) is logits


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
                                    dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
                                    dict(presence_penalty=float("nan")), dict(repetition_penalty=float("inf")),
                                    dict(temperature=float("nan")), dict(logprobs=21), dict(logprobs=-1),
                                    dict(logprobs=True), dict(logprobs=2.0)])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingSpec(**kwargs)


def test_min_p_keeps_only_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # these probabilities at temperature 1
    gen = torch.Generator().manual_seed(0)

    def drawn(min_p: float) -> set[int]:
        return {sample_token(logits, SamplingSpec(min_p=min_p), gen) for _ in range(300)}

    assert drawn(0.5) == {0, 1}  # p >= 0.25
    assert drawn(0.2) == {0, 1, 2}  # p >= 0.1
    assert drawn(1.0) == {0}
    assert drawn(0.0) == {0, 1, 2, 3}  # off


SMALLEST, LARGEST = 5e-324, 1.7976931348623157e308  # the extreme finite floats a request may hold


@pytest.mark.parametrize("kwargs,drawn", [
    (dict(repetition_penalty=1.401298464324817e-45), {0}),  # CI's Schemathesis case (float32's smallest)
    (dict(repetition_penalty=SMALLEST), {0}),  # 3 / p: far past float32's max, the certain token
    (dict(repetition_penalty=LARGEST), {0, 1, 3, 4}),  # token 2's -2 * p: -inf; token 1's 0 * p was NaN
    (dict(temperature=SMALLEST), {0}),  # greedy (0 in float32: a division by 0)
    (dict(temperature=1e-5), {0}),  # the logit gap of 2 divided by 1e-5: token 3's probability is e^-200000
    (dict(temperature=2.0, top_p=SMALLEST, min_p=1.0), {0}),
    (dict(repetition_penalty=SMALLEST, temperature=1e-5, presence_penalty=-2.0, frequency_penalty=2.0), {0}),
])
def test_no_accepted_sampling_value_makes_the_distribution_non_finite(kwargs, drawn):
    """Each value the protocol accepts, however extreme, samples a token (torch.multinomial refused
    the NaN or inf a penalty or temperature made: "probability tensor contains either inf, nan")."""
    logits = torch.tensor([3.0, 0.0, -2.0, 1.0, -0.5])
    prompt, output = [0, 1, 2], [2]
    params = SamplingSpec(**kwargs)
    gen = torch.Generator().manual_seed(0)
    got = {sample_token(logits, params, gen, prompt, output) for _ in range(200)}
    assert got <= drawn and (len(drawn) > 1 or got == drawn), got
    assert torch.isfinite(apply_penalties(logits, params, prompt, output)).all()


def test_token_logprobs_are_the_log_softmax_and_its_top_k():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3])
    logp = torch.log_softmax(logits, -1)
    chosen, top = token_logprobs(logits, 2, 3)
    assert chosen == pytest.approx(float(logp[2]))
    assert [t for t, _ in top] == [1, 3, 4]
    assert [lp for _, lp in top] == pytest.approx([float(logp[i]) for i in (1, 3, 4)])
    assert token_logprobs(logits, 0, 0) == (pytest.approx(float(logp[0])), ())


# -- the engine against Hugging Face ---------------------------------------------------------


def test_logprobs_equal_hf_log_softmax_in_a_batch_and_after_a_hand_over(engine, ref):
    """Logprobs are the raw model's (log-softmax of its logits), whatever the penalties and the
    temperature did to the choice; each request in a batch gets its own."""
    engine.add_request("greedy", PROMPT, SamplingSpec(temperature=0, max_tokens=12, logprobs=20))
    engine.add_request("sampled", OTHER, SamplingSpec(temperature=1.3, top_p=0.9, seed=5, max_tokens=12,
                                                        frequency_penalty=1.0, repetition_penalty=1.2, logprobs=5))
    engine.add_request("chosen-only", PROMPT, SamplingSpec(temperature=0.7, seed=1, max_tokens=6, logprobs=0))
    engine.add_request("none", OTHER, SamplingSpec(temperature=0, max_tokens=6))
    out = drain(engine)
    assert all(o.logprob is None and o.top_logprobs == () for o in out["none"])
    assert all(o.top_logprobs == () and o.logprob is not None for o in out["chosen-only"])
    for rid, prompt, k in (("greedy", PROMPT, 20), ("sampled", OTHER, 5), ("chosen-only", PROMPT, 0)):
        tokens = [o.token_id for o in out[rid]]
        want = torch.log_softmax(hf_step_logits(ref, prompt, tokens), dim=-1)
        for i, o in enumerate(out[rid]):
            assert o.logprob == pytest.approx(float(want[i, o.token_id]), abs=1e-4), (rid, i)
            if k:
                values, ids = torch.topk(want[i], k)
                assert [t for t, _ in o.top_logprobs] == ids.tolist(), (rid, i)
                assert [lp for _, lp in o.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        if rid == "greedy":  # the greedy token is the most likely one
            assert all(o.token_id == o.top_logprobs[0][0] for o in out[rid])
    # Handed over after 5 tokens (KV recompute with its generated ids): the same logprobs go on.
    tokens = [o.token_id for o in out["sampled"]]
    params = SamplingSpec(temperature=0, max_tokens=12, frequency_penalty=1.0, repetition_penalty=1.2, logprobs=5)
    engine.add_request("moved", OTHER, params, generated_ids=tokens[:5])
    moved = drain(engine)["moved"]
    want = torch.log_softmax(hf_step_logits(ref, OTHER, tokens[:5] + [o.token_id for o in moved]), dim=-1)
    for i, o in enumerate(moved, start=5):
        assert o.logprob == pytest.approx(float(want[i, o.token_id]), abs=1e-4)
        assert [t for t, _ in o.top_logprobs] == torch.topk(want[i], 5).indices.tolist()


def greedy_tokens(engine: Engine, rid: str, prompt: list[int], n: int, **kw) -> list[int]:
    engine.add_request(rid, prompt, SamplingSpec(temperature=0, max_tokens=n, **kw))
    return [o.token_id for o in drain(engine)[rid]]


def test_penalized_greedy_follows_the_definitions_step_by_step(engine, ref):
    """Each greedy token is the argmax of HF's logits for prompt + tokens so far with the
    penalties applied by hand; requests with and without penalties share the batch."""
    n = 24
    cases = {"freq": dict(frequency_penalty=0.3), "pres": dict(presence_penalty=0.2),
             "rep": dict(repetition_penalty=1.4), "all": dict(presence_penalty=-0.1, frequency_penalty=0.15,
                                                              repetition_penalty=0.9)}
    for rid, kw in cases.items():
        engine.add_request(rid, PROMPT, SamplingSpec(temperature=0, max_tokens=n, **kw))
    engine.add_request("plain", PROMPT, SamplingSpec(temperature=0, max_tokens=n))
    out = {rid: [o.token_id for o in outs] for rid, outs in drain(engine).items()}
    assert out["plain"] == greedy_tokens(engine, "alone", PROMPT, n)  # a neighbour's penalties do not leak
    for rid, kw in cases.items():
        tokens = out[rid]
        assert tokens != out["plain"], rid  # the penalty changed the output, so the check below means something
        logits = hf_step_logits(ref, PROMPT, tokens)
        for i, t in enumerate(tokens):
            penalized = by_hand(logits[i].tolist(), PROMPT, tokens[:i], kw.get("presence_penalty", 0.0),
                                kw.get("frequency_penalty", 0.0), kw.get("repetition_penalty", 1.0))
            best = max(range(len(penalized)), key=penalized.__getitem__)
            assert t == best, (rid, i)


def test_a_large_frequency_penalty_never_repeats_a_greedy_token(engine, ref):
    n = 40
    plain = greedy_tokens(engine, "plain", PROMPT, n)
    assert len(set(plain)) < n  # unpenalized, the tiny model repeats itself
    tokens = greedy_tokens(engine, "freq", PROMPT, n, frequency_penalty=2.0)
    # Every step's logits span less than 2, so a token seen once (-2) always loses to one never seen.
    logits = hf_step_logits(ref, PROMPT, tokens)
    assert float((logits.max(-1).values - logits.min(-1).values).max()) < 2.0
    assert len(set(tokens)) == n
    # A negative presence penalty does the opposite: the first token, once seen, wins forever.
    stuck = greedy_tokens(engine, "stuck", PROMPT, 8, presence_penalty=-2.0)
    assert stuck == [plain[0]] * 8


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_hf_generate(block_dir, ref, penalty):
    engine = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=256)  # eos stops, as in HF
    eos = set(ref.generation_config.eos_token_id)
    n = 30
    for prompt in (PROMPT, OTHER):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, repetition_penalty=penalty)[0, len(prompt):].tolist()
            plain = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()
        assert want != plain
        got = greedy_tokens(engine, "r", prompt, n, repetition_penalty=penalty)
        assert got == want
        assert len(got) == n or got[-1] in eos


def test_penalties_survive_a_hand_over(engine):
    """A request resumed elsewhere with its generated ids (KV recompute) goes on with the same
    counts: the rest of its tokens are those it would have produced had it stayed."""
    kw = dict(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.25)
    whole = greedy_tokens(engine, "whole", PROMPT, 20, **kw)
    for at in (1, 7, 13):
        engine.add_request(f"moved{at}", PROMPT, SamplingSpec(temperature=0, max_tokens=20, **kw),
                           generated_ids=whole[:at])
        assert whole[:at] + [o.token_id for o in drain(engine)[f"moved{at}"]] == whole
    # Seeded sampling with penalties is reproducible too.
    sampled = dict(temperature=1.0, seed=3, max_tokens=16, **kw)
    runs = []
    for rid in ("s1", "s2"):
        engine.add_request(rid, OTHER, SamplingSpec(**sampled))
        runs.append([o.token_id for o in drain(engine)[rid]])
    assert runs[0] == runs[1]
