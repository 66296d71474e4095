"""Constrained decoding (structured output): a request's grammar limits the tokens it may sample.

Built on llguidance (Microsoft's guidance engine, maintained; a Rust core computing the mask of
allowed tokens over the whole vocabulary in microseconds a step; JSON Schema and Lark grammars;
a Hugging Face tokenizer adapter; a CPU wheel). xgrammar and outlines-core do similar work;
llguidance was chosen for its Lark grammars with embedded JSON schemas (one grammar for "a tool
call or a JSON answer"), its schema coverage, and a matcher with rollback and error states
instead of exceptions.

A grammar arrives as text (llguidance's JSON grammar format, made and validated by the gateway).
Each step, before sampling, the tokens the grammar does not allow get a logit of -inf (after the
penalties, before temperature, top-p or greedy); the sampled token is then consumed by the
request's matcher. Once the grammar is complete and nothing can follow (`finished`), the request
ends on that token ("stop"), so the text is exactly what the grammar matched; while it is
complete but could go on (a number's digits), the request's stop tokens are allowed too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


@lru_cache(maxsize=16)
def grammar_tokenizer(tokenizer_dir: str):
    """llguidance's view of the tokenizer in `tokenizer_dir` (a checkpoint's folder): made once per
    model on the first constrained request (about 0.2 s for a 50k vocabulary), never otherwise."""
    import llguidance.hf
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))


class Constraint:
    """One request's grammar state: the allowed tokens for its next step, and the tokens it took."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int, stop_ids: Iterable[int] = ()):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar: {self.matcher.get_error()}")
        self.vocab_size = vocab_size
        self.stop_ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next. Model ids past the tokenizer's
        (a vocabulary padded for alignment) are never allowed."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        bits = ((words.unsqueeze(1) >> _SHIFTS) & 1).bool().flatten()
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, bits.numel())
        allowed[:n] = bits[:n]
        if self.stop_ids and (self.matcher.is_accepting() or not allowed.any()):
            allowed[self.stop_ids] = True  # complete (or, should nothing be allowed, stuck): it may end here
        return allowed

    def consume(self, tokens: Sequence[int]) -> None:
        """The request took these tokens (sampled, or generated elsewhere before a hand-over)."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise ValueError(f"tokens {list(tokens)[:8]} do not follow the grammar: {self.matcher.get_error()}")

    def take(self, token: int) -> bool:
        """A sampled token (always one the mask allowed); False if the matcher refused it."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow."""
        return self.matcher.is_stopped()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`logits` [vocab] with the tokens not `allowed` at -inf (a new float32 tensor)."""
    return logits.float().masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
