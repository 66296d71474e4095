"""The streaming detokenizer: its deltas add up to the full decode, and each token costs
the same small amount of decoding however long the sequence grows."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.gateway.text import IncrementalDetokenizer

MULTI_BYTE = "é ü € 中文 日本語 😀 🚀 ñandú"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)  # the one the gateway loads


def stream(tokenizer, ids: list[int]) -> tuple[str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return "".join(deltas), detok


def id_lists(tokenizer):
    # Any id (byte tokens alone are often a piece of a character, or invalid UTF-8), the ids of
    # multi-byte characters, and the special tokens (skipped in the text).
    pieces = sorted(set(tokenizer(MULTI_BYTE, add_special_tokens=False).input_ids))
    return st.lists(st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(pieces),
                              st.sampled_from(tokenizer.all_special_ids)), max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_equals_the_full_decode_of_any_ids(tokenizer, data):
    ids = data.draw(id_lists(tokenizer))
    text, detok = stream(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=40))
def test_streamed_text_equals_the_full_decode_of_any_text(tokenizer, source):
    ids = tokenizer(source, add_special_tokens=False).input_ids
    text, _ = stream(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_character_split_over_tokens_is_sent_whole(tokenizer):
    ids = tokenizer("€", add_special_tokens=False).input_ids
    assert len(ids) > 1  # the demo vocabulary has no token for it: one byte per token
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in ids] == [""] * (len(ids) - 1) + ["€"]


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self._tokenizer, self.calls = tokenizer, []

    def decode(self, ids, **kwargs):
        self.calls.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)


def test_decoding_work_per_token_stays_bounded_as_the_sequence_grows(tokenizer):
    source = ("The quick brown fox jumps over the lazy dog. " + MULTI_BYTE + " ") * 200
    ids = tokenizer(source, add_special_tokens=False).input_ids[:2000]
    assert len(ids) == 2000
    counting = CountingTokenizer(tokenizer)
    text, _ = stream(counting, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    # Two windows per token, each a few tokens long (the longest character here is 4 bytes):
    # the same at token 2000 as at token 10, where re-decoding everything grows to 2000.
    assert max(counting.calls) <= 10, max(counting.calls)
    assert sum(counting.calls) <= 10 * len(ids)
