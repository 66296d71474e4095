"""Token logprobs in the OpenAI shapes: chat's `logprobs.content` entries and the legacy
completions object (tokens, token_logprobs, top_logprobs, text_offset).

The logprobs are the engine's: the log-softmax of the model's own logits (before penalties
and temperature, as vLLM returns them). A token's string is the decode of its id alone, as
vLLM gives it; its bytes are the token's own bytes where the tokenizer is byte-level BPE
(a token that is part of a UTF-8 character decodes to U+FFFD alone, its bytes are still
right), else the UTF-8 of that string.
"""

from __future__ import annotations

from dataclasses import dataclass

# A logprob that underflowed to -inf goes out as this (JSON has no infinity), as vLLM does.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its logprob and the most likely (token id, logprob) alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _byte_level_map(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte-to-unicode table reversed, if the tokenizer decodes byte-level BPE."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ + repr(decoder)[:40]:
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenStrings:
    """Token id -> its string and bytes for one tokenizer (cached: a vocabulary is small)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._bytes_of = _byte_level_map(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            text = self._tokenizer.decode([token_id])
            raw = None
            if self._bytes_of is not None and token_id not in self._special:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and piece and all(c in self._bytes_of for c in piece):
                    raw = [self._bytes_of[c] for c in piece]
            found = self._cache[token_id] = (text, raw if raw is not None else list(text.encode("utf-8")))
        return found

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def chat_content(strings: TokenStrings, items: list[TokenLogprob]) -> list[dict]:
    """Chat `choices[i].logprobs.content` entries."""
    out = []
    for item in items:
        token, raw = strings.get(item.token_id)
        out.append({"token": token, "logprob": _clamp(item.logprob), "bytes": raw,
                    "top_logprobs": [{"token": t, "logprob": _clamp(lp), "bytes": b}
                                     for (t, b), lp in ((strings.get(i), lp) for i, lp in item.top)]})
    return out


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built a token (or a chunk's tokens) at a time:
    `top_logprobs` maps the k most likely tokens' strings, and the sampled token's, to their
    logprobs (so up to k + 1 entries, as the OpenAI API says); `text_offset` is where each
    token's string starts, counted over the token strings (vLLM's rule) from `offset`."""

    def __init__(self, strings: TokenStrings, k: int, offset: int = 0):
        self.strings, self.k, self.offset = strings, k, offset

    def take(self, items: list[TokenLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for item in items:
            token = self.strings.text(item.token_id)
            top = {self.strings.text(i): _clamp(lp) for i, lp in item.top[: self.k]}
            top.setdefault(token, _clamp(item.logprob))
            out["tokens"].append(token)
            out["token_logprobs"].append(_clamp(item.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out
