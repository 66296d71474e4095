"""Next-token selection, by the protocol's `SamplingSpec` as the gateway sent it (its
parameters are declared and validated there once).

A step's logits for a request go through, in order (vLLM's order): the repetition penalty
(HF/vLLM: a logit of a token seen in the prompt or the output is divided by the penalty when
positive, multiplied when not), then the OpenAI frequency and presence penalties (counts over
the tokens generated so far), then a grammar's mask (constrained decoding, grammar.py: the
tokens it does not allow at -inf), then temperature, min-p and top-p. Every value the protocol
accepts keeps the distribution finite: the penalties are computed in float64 and clamped to
float32's finite range (a repetition penalty of 1e-45 divides a logit past float32's max), and the
temperature divides the logits less their maximum (at most 0). The penalties are derived
from the request's ids every step, so a request handed over with its generated ids (KV
recompute) goes on exactly as if it had stayed.

Logprobs, when asked for, are the log-softmax of the model's own logits (before penalties, a
grammar's mask and temperature), as vLLM returns by default: what the model thinks, whatever the sampler did.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.protocol.messages import SamplingSpec

from .grammar import mask_logits


def _penalized(params: SamplingSpec) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def make_generator(params: SamplingSpec, device: str | torch.device = "cpu", choice: int = 0) -> torch.Generator:
    """A per-request generator, so one request's sampling never shifts another's random stream.
    Choice i of a seeded request is seeded with seed + i: reproducible, and different from the
    request's other choices (choice 0 samples exactly as the same request with n = 1)."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed + choice)
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingSpec, prompt_ids: Sequence[int] = (),
                    output_ids: Sequence[int] = ()) -> torch.Tensor:
    """`logits` [vocab] with the request's penalties applied (a new float32 tensor of finite values,
    given finite logits; the same tensor when there are none)."""
    if not _penalized(params):
        return logits
    logits = logits.double()  # a new tensor; in float32 a penalty of 1e39 is inf, and 0 * inf is NaN
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[torch.tensor([*prompt_ids, *output_ids], device=logits.device)] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), device=logits.device), minlength=vocab)[:vocab]
        logits = logits - params.frequency_penalty * counts.double() - params.presence_penalty * (counts > 0).double()
    f32 = torch.finfo(torch.float32)
    return logits.clamp(f32.min, f32.max).float()


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under `logits` [vocab] (the model's own distribution), and
    the `top` most likely (token id, logprob) pairs, most likely first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token])
    if top <= 0:
        return chosen, ()
    values, ids = torch.topk(logp, min(top, logp.shape[-1]))
    return chosen, tuple(zip(ids.tolist(), values.tolist()))


def sample_token(logits: torch.Tensor, params: SamplingSpec, generator: torch.Generator | None,
                 prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                 allowed: torch.Tensor | None = None) -> int:
    """Pick the next token from 1-D `logits` [vocab], given the request's ids so far (penalties)
    and, with a grammar, the tokens it allows ([vocab] bool)."""
    logits = apply_penalties(logits, params, prompt_ids, output_ids)
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float()
    # Less the maximum first (softmax's own shift, so the same distribution): a small temperature then
    # scales values <= 0 towards -inf, never a finite logit to inf (inf - inf: NaN).
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.min_p > 0:
        # vLLM's min_p: only the tokens at least min_p times as likely as the likeliest one.
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        # Nucleus: the smallest prefix of tokens (by probability) whose mass reaches top_p.
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
        keep[0] = True  # the likeliest always (a top_p under float32's smallest is 0 there: 0 < 0 kept none)
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
