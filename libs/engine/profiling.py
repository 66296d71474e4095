"""LLM-Mesh §5.2 performance quantification: measure a model's prefill time against prompt
length and its decode-iteration time against batch size x mean sequence length, on this
device, with the serving engine itself (the numbers a worker's scheduler will see).

Samples are powers of two (`sample_points`), so a profile up to L_max tokens and B_max requests
takes O(log L_max * log B_max) measurements. Each is the median of `repeats` timed steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from libs.planning.mesh import Profile, sample_points

from .engine import Engine
from .sampling import SamplingSpec


def _prompt(length: int, vocab: int, salt: int) -> list[int]:
    # Arbitrary in-vocabulary ids; distinct per request so nothing could be shared between rows.
    return [(7 + 31 * i + 101 * salt) % (vocab - 1) + 1 for i in range(length)]


def measure_profile(make_engine: Callable[[int, int], Engine], max_len: int, max_batch: int,
                    repeats: int = 3, clock: Callable[[], float] = time.perf_counter) -> Profile:
    """A :class:`Profile` measured on engines from `make_engine(max_batch_size, max_seq_len)`.

    Prefill: one request of each sampled length, the step that prefills it timed (the prefill
    chunk is raised to the length, so one step is one prefill). Decode: for each sampled batch
    size and mean length, one prompt prefilled and forked into that many rows, then `repeats`
    decode steps timed.

    `clock`: wall time by default; `time.thread_time` (CPU time of a one-thread torch on CPU)
    leaves out what other processes of a busy machine take from it (`layercast simulate-profile`)."""
    lengths, batches = sample_points(max_len), sample_points(max_batch)
    engine = make_engine(max_batch, max_len + repeats + 2)
    # One step prefills a whole sampled batch, so no row decodes before the timed steps.
    engine.prefill_chunk = max(engine.prefill_chunk, max_len)
    engine.token_budget = max(engine.token_budget, max_len * max_batch + max_batch)
    greedy = SamplingSpec(temperature=0.0, max_tokens=repeats + 2, stop_token_ids=())
    engine.eos_token_ids = frozenset()  # a random model may emit its EOS: keep every row decoding

    def timed_step() -> float:
        t0 = clock()
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return clock() - t0

    engine.add_request("warm-up", _prompt(max_len, engine.vocab_size, 0), greedy)
    while engine.has_work():  # the first passes pay one-time costs (allocation, kernel choice)
        engine.step()

    prefill = []
    for n in lengths:
        times = []
        for k in range(repeats):
            engine.add_request(f"p{n}-{k}", _prompt(n, engine.vocab_size, k), greedy)
            times.append(timed_step())
            engine.cancel(f"p{n}-{k}")
        prefill.append(statistics.median(times))

    decode = []
    for b in batches:
        row = []
        for n in lengths:
            # One prompt prefilled once and its KV copied into b rows (n = b choices): a decode
            # step over b rows of n tokens costs what b distinct requests would, and the profile
            # pays n tokens of prefill for it instead of b x n.
            rid = f"d{b}-{n}"
            engine.add_request(rid, _prompt(n, engine.vocab_size, b), greedy.model_copy(update={"n": b}))
            if len(engine.step()) != b:  # the untimed prefill: every row decodes next
                raise RuntimeError(f"the prefill of {n} tokens for {b} rows did not fit one step")
            row.append(statistics.median(timed_step() for _ in range(repeats)))
            engine.cancel(rid)
        decode.append(tuple(row))
    return Profile(lengths, tuple(prefill), batches, lengths, tuple(decode))
