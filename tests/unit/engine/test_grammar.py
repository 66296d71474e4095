"""libs.engine constrained decoding (llguidance): a random model, which knows nothing of JSON,
still writes output that validates against any schema it is given, ends exactly where the
grammar does, and goes on under its grammar when resumed elsewhere (hand-over)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import SCHEMAS
from llguidance import LLMatcher
from test_engine import drain
from transformers import AutoTokenizer

from libs.engine import Constraint, Engine, SamplingSpec, grammar_tokenizer
from libs.engine.grammar import mask_logits

# Compact-ish JSON with fixed separators, as the gateway asks (services/gateway/structured.py).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
PROMPT = [1, 17, 200, 45, 301, 99, 7, 450, 12, 64]


def grammar(schema: dict) -> str:
    g = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    assert LLMatcher.validate_grammar(g) == ""
    return g


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_checkpoint(tiny_checkpoint, max_batch_size=8, max_seq_len=1024)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def run(engine: Engine, tokenizer, schema: dict | None, **params) -> tuple[str, list]:
    engine.add_request("r", PROMPT, SamplingSpec(grammar=grammar(schema) if schema else None, **params))
    outs = drain(engine)["r"]
    ids = [o.token_id for o in outs if o.token_id not in engine.eos_token_ids]
    return tokenizer.decode(ids), outs


# -- generated schemas (tests/schema_strategies.py) ----------------------------------------------------


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31))
def test_a_random_model_writes_json_that_validates_against_any_schema(engine, tokenizer, schema, seed):
    text, outs = run(engine, tokenizer, schema, max_tokens=400, temperature=1.0, seed=seed)
    assert outs[-1].finish_reason == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)


def test_output_ends_where_the_grammar_does_and_logprobs_stay_the_models(engine, tokenizer):
    text, outs = run(engine, tokenizer, PERSON, max_tokens=200, temperature=0.7, seed=3, logprobs=2)
    value = json.loads(text)  # nothing after the object: it ended on its closing brace, not on an EOS
    jsonschema.validate(value, PERSON)
    assert text.startswith('{"name": "') and text.endswith("}") and outs[-1].token_id not in engine.eos_token_ids
    assert outs[-1].finish_reason == "stop"
    # Logprobs are the model's own (unmasked) distribution: the top tokens are mostly not JSON.
    assert all(o.logprob is not None and len(o.top_logprobs) == 2 for o in outs)
    # Without the grammar the same seed writes no JSON at all.
    free, _ = run(engine, tokenizer, None, max_tokens=len(outs), temperature=0.7, seed=3)
    assert not free.startswith('{"name"')


def test_json_object_is_any_object_and_unconstrained_neighbours_are_untouched(engine, tokenizer):
    alone, _ = run(engine, tokenizer, None, max_tokens=12, temperature=0)
    engine.add_request("json", PROMPT, SamplingSpec(grammar=grammar({"type": "object"}), max_tokens=300,
                                                      temperature=0.8, seed=5))
    engine.add_request("free", PROMPT, SamplingSpec(max_tokens=12, temperature=0))
    out = drain(engine)
    ids = [o.token_id for o in out["json"] if o.token_id not in engine.eos_token_ids]
    if out["json"][-1].finish_reason == "stop":
        assert isinstance(json.loads(tokenizer.decode(ids)), dict)
    else:  # a random model may write a long object: what it wrote so far is an object's beginning
        assert tokenizer.decode(ids).startswith("{")
    assert tokenizer.decode([o.token_id for o in out["free"]]) == alone


@pytest.mark.parametrize("at", [1, 5, 12])
def test_a_resumed_request_goes_on_under_its_grammar(engine, tokenizer, at):
    """Hand-over (KV recompute): the generated ids are replayed into a new matcher, so the
    resumed request continues the same JSON (greedy: the very same tokens)."""
    params = SamplingSpec(grammar=grammar(PERSON), max_tokens=200, temperature=0)
    engine.add_request("full", PROMPT, params)
    full = [o.token_id for o in drain(engine)["full"]]
    assert len(full) > at
    engine.add_request("resumed", PROMPT, params, generated_ids=full[:at])
    resumed = [o.token_id for o in drain(engine)["resumed"]]
    assert full[:at] + resumed == full
    jsonschema.validate(json.loads(tokenizer.decode(full)), PERSON)


def test_tokens_off_the_grammar_are_refused_on_resume(engine):
    bad = [17, 200]  # not a JSON object's start
    with pytest.raises(ValueError, match="do not follow the grammar"):
        engine.add_request("bad", PROMPT, SamplingSpec(grammar=grammar(PERSON), max_tokens=20), generated_ids=bad)
    assert engine.num_requests == 0


def test_padded_vocabulary_ids_are_never_allowed(tiny_checkpoint):
    tok = grammar_tokenizer(str(tiny_checkpoint))
    c = Constraint(tok, grammar({"type": "object"}), vocab_size=tok.vocab_size + 77, stop_ids=[2])
    allowed = c.allowed()
    assert allowed.shape == (tok.vocab_size + 77,) and allowed.any()
    assert not allowed[tok.vocab_size:].any()
    masked = mask_logits(torch.zeros(tok.vocab_size + 77), allowed)
    assert torch.isinf(masked[~allowed]).all() and (masked[allowed] == 0).all()
