"""Sampling parameters and next-token selection.

A step's logits for a request go through, in order (vLLM's order): the repetition penalty
(HF/vLLM: a logit of a token seen in the prompt or the output is divided by the penalty when
positive, multiplied when not), then the OpenAI frequency and presence penalties (counts over
the tokens generated so far), then a grammar's mask (constrained decoding, grammar.py: the
tokens it does not allow at -inf), then temperature and top-p. The penalties are derived from the
request's ids every step, so a request handed over with its generated ids (KV recompute) goes
on exactly as if it had stayed.

Logprobs, when asked for, are the log-softmax of the model's own logits (before penalties, a
grammar's mask and temperature), as vLLM returns by default: what the model thinks, whatever the sampler did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grammar import mask_logits

MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's chat limit)


def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None  # same seed, same prompt, same model -> same tokens
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # OpenAI: logit -= presence * (count > 0), over the output
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency * count, over the output
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt and output, logit / p if > 0 else logit * p
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens'.
    logprobs: int | None = None
    # Constrained decoding: an llguidance grammar (grammar.py) the output must match; None: free.
    grammar: str | None = None
    n: int = 1  # choices: completions of one prompt, each in its own KV slot (the prompt prefilled once)

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stop = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)  # accept lists, store a hashable tuple
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar must be None or a non-empty string")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def make_generator(params: SamplingParams, device: str | torch.device = "cpu", choice: int = 0) -> torch.Generator:
    """A per-request generator, so one request's sampling never shifts another's random stream.
    Choice i of a seeded request is seeded with seed + i: reproducible, and different from the
    request's other choices (choice 0 samples exactly as the same request with n = 1)."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed + choice)
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int] = (),
                    output_ids: Sequence[int] = ()) -> torch.Tensor:
    """`logits` [vocab] with the request's penalties applied (a new float32 tensor; the same
    tensor when there are none)."""
    if not params.penalized:
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[torch.tensor([*prompt_ids, *output_ids], device=logits.device)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), device=logits.device), minlength=vocab)[:vocab]
        logits = logits - params.frequency_penalty * counts.float() - params.presence_penalty * (counts > 0).float()
    return logits


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under `logits` [vocab] (the model's own distribution), and
    the `top` most likely (token id, logprob) pairs, most likely first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token])
    if top <= 0:
        return chosen, ()
    values, ids = torch.topk(logp, min(top, logp.shape[-1]))
    return chosen, tuple(zip(ids.tolist(), values.tolist()))


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                 allowed: torch.Tensor | None = None) -> int:
    """Pick the next token from 1-D `logits` [vocab], given the request's ids so far (penalties)
    and, with a grammar, the tokens it allows ([vocab] bool)."""
    logits = apply_penalties(logits, params, prompt_ids, output_ids)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        # Nucleus: the smallest prefix of tokens (by probability) whose mass reaches top_p.
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
