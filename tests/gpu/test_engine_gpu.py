"""The engine on the target device: greedy tokens of the demo architectures (Llama, Qwen2) equal
Hugging Face `generate()` on the same device, one request at a time and 16 at once, and a split
into two layer ranges gives the whole model's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest_models import N_BLOCKS, reference_model

from libs.engine import Engine, SamplingSpec

pytestmark = pytest.mark.gpu

NEW_TOKENS = 12
# 16 prompts of different lengths (3..34 tokens), so a batch holds rows at different positions.
PROMPTS = [[(7 + 31 * i + 13 * k) % 500 + 5 for k in range(3 + 2 * i)] for i in range(16)]


def engine_tokens(engine: Engine, prompts: list[list[int]], at_once: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of each prompt, `at_once` requests in the engine together; the most rows any step decoded."""
    out: dict[int, list[int]] = {}
    widest = 0
    for start in range(0, len(prompts), at_once):
        for i in range(start, min(start + at_once, len(prompts))):
            engine.add_request(str(i), prompts[i], SamplingSpec(temperature=0, max_tokens=NEW_TOKENS))
        while engine.has_work():
            for o in engine.step():
                out.setdefault(int(o.request_id), []).append(o.token_id)
            widest = max(widest, engine.last_step.decode_rows)
    return [out[i] for i in range(len(prompts))], widest


@pytest.fixture(scope="module")
def generated(hf_dir, device) -> list[list[int]]:
    """transformers' generate() on the device, one prompt at a time (stopping at the model's eos, as the engine does)."""
    model = reference_model(hf_dir).to(device)
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p], device=device)
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS)
            out.append(tokens[0, len(p):].tolist())
    return out


def _engine(block_dir, device, splits=()) -> Engine:
    return Engine.from_checkpoint(block_dir, device=device, splits=splits, max_batch_size=16, max_seq_len=128)


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_equal_hf_generate_on_the_device(block_dir, device, generated, batch):
    engine = _engine(block_dir, device)
    assert engine.model.embed_tokens.weight.device.type == device.type
    assert all(t.device.type == device.type for t in engine.stages[0].kv.keys)
    got, widest = engine_tokens(engine, PROMPTS, batch)
    # Prompts prefill over a few steps and some rows stop at eos: batch 16 still decodes most rows at once.
    assert widest == 1 if batch == 1 else widest >= 8
    assert got == generated


def test_two_layer_ranges_give_the_whole_models_tokens(block_dir, device, generated):
    whole, _ = engine_tokens(_engine(block_dir, device), PROMPTS, 16)
    split = _engine(block_dir, device, splits=(1,))
    assert [(st.model.block_start, st.model.block_end) for st in split.stages] == [(0, 1), (1, N_BLOCKS)]
    assert all(st.model.device.type == device.type for st in split.stages)
    got, _ = engine_tokens(split, PROMPTS, 16)
    assert got == whole == generated


def test_a_profile_measured_on_the_device_waits_for_every_timed_step(block_dir, device, monkeypatch):
    """LLM-Mesh profiling (libs/engine/profiling.py): on CUDA each timed step synchronizes the
    device, or the times would be kernel launches, not the kernels."""
    from libs.engine.profiling import measure_profile

    synced: list[torch.device] = []
    if device.type == "cuda":
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(torch.device(d)) or real(d))
    profile = measure_profile(lambda b, s: Engine.from_checkpoint(block_dir, device=device, max_batch_size=b,
                                                                  max_seq_len=s), max_len=16, max_batch=4, repeats=2)
    timed_steps = 2 * len(profile.prefill_lengths) + 2 * len(profile.batches) * len(profile.lengths)
    assert len(synced) == (timed_steps if device.type == "cuda" else 0)
    assert all(d.type == "cuda" for d in synced)
    assert all(t > 0 for t in profile.prefill_s) and all(t > 0 for row in profile.decode_s for t in row)
