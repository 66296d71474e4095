"""services.gateway.logprobs: token strings and bytes, and the OpenAI logprobs shapes."""

import json

import pytest
from transformers import AutoTokenizer

from services.gateway.logprobs import LOGPROB_FLOOR, CompletionLogprobs, TokenLogprob, TokenStrings, chat_content


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_token_bytes_are_the_tokens_own_even_inside_a_character(tokenizer):
    strings = TokenStrings(tokenizer)
    text = "naïve café → 東京 ok"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    # Some token holds part of a character: alone it decodes to U+FFFD, its bytes are still its own.
    assert any("\ufffd" in strings.text(t) for t in ids)
    assert bytes(b for t in ids for b in strings.get(t)[1]) == text.encode("utf-8")
    for t in range(len(tokenizer)):
        token, raw = strings.get(t)
        assert token == tokenizer.decode([t])
        if "\ufffd" not in token:
            assert bytes(raw).decode("utf-8") == token, t


def test_chat_entries_and_the_legacy_object(tokenizer):
    strings = TokenStrings(tokenizer)
    ids = tokenizer(" the sea is blue", add_special_tokens=False).input_ids
    items = [TokenLogprob(t, -1.0 - i, ((t, -1.0 - i), (ids[0], -2.5), (5, float("-inf"))))
             for i, t in enumerate(ids)]
    content = chat_content(strings, items)
    assert [e["token"] for e in content] == [tokenizer.decode([t]) for t in ids]
    assert [e["logprob"] for e in content] == [-1.0 - i for i in range(len(ids))]
    assert [len(e["top_logprobs"]) for e in content] == [3] * len(ids)
    assert content[0]["top_logprobs"][2]["logprob"] == LOGPROB_FLOOR  # never -inf: JSON has none
    json.dumps(content, allow_nan=False)

    legacy = CompletionLogprobs(strings, k=1, offset=4)
    first = legacy.take(items[:2])
    rest = legacy.take(items[2:])
    tokens = [tokenizer.decode([t]) for t in ids]
    assert first["tokens"] + rest["tokens"] == tokens
    offsets = [4 + sum(len(t) for t in tokens[:i]) for i in range(len(ids))]
    assert first["text_offset"] + rest["text_offset"] == offsets  # running on across chunks
    # The top k (1 here), and the sampled token's always: up to k + 1 entries.
    assert first["top_logprobs"][0] == {tokens[0]: -1.0}
    assert first["top_logprobs"][1] == {tokens[1]: -2.0}
    off_top = TokenLogprob(ids[1], -3.0, ((ids[0], -0.5), (ids[1], -3.0)))
    assert CompletionLogprobs(strings, k=1).take([off_top])["top_logprobs"] == [{tokens[0]: -0.5, tokens[1]: -3.0}]
