"""libs.engine: layer ranges over block buffers match Hugging Face exactly; the local Engine serves requests."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from conftest_models import N_BLOCKS, arch, block_dir, hf_dir, load_all, reference_model  # noqa: F401  (fixtures)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, MistralConfig, Qwen2Config

from libs.checkpoint import CheckpointIndex, convert_checkpoint
from libs.engine import SUPPORTED_MODEL_TYPES, AdmissionError, Engine, LayerRange, SamplingSpec, warm_up

PROMPT = [1, 17, 200, 45, 301, 99, 7, 450, 12, 64]
DECODE = [42, 7, 333, 2]


@pytest.fixture(scope="module")
def loaded(block_dir):
    return load_all(block_dir)


@pytest.fixture(scope="module")
def ref(hf_dir):
    return reference_model(hf_dir)


def hf_logits(model, prompt, decode):
    """Prefill logits, then the logits of each single-token decode step (HF with its own cache)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = [model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits]
        for t in decode:
            out.append(model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits)
    return out


def run_stages(stages, prompt, decode):
    """The same through a pipeline of stages, each with its own cache, passing hidden states on."""
    caches = [s.new_cache() for s in stages]
    out = []
    for ids in [prompt, *[[t] for t in decode]]:
        x = torch.tensor([ids])
        for stage, cache in zip(stages, caches):
            x = stage(x, cache)
        out.append(x)
    return out


# -- params are views over the block buffers ------------------------------------------------


def test_parameters_are_views_into_block_buffers(loaded):
    index, blocks = loaded
    model = LayerRange(index, blocks)
    spans = {b: (buf.data_ptr(), buf.data_ptr() + buf.numel()) for b, buf in blocks.items()}

    def block_holding(t):
        hits = [b for b, (lo, hi) in spans.items() if lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi]
        assert len(hits) == 1
        return hits[0]

    params = dict(model.named_parameters())
    assert len(params) == len(index.tensors)
    for name, p in params.items():
        assert not p.requires_grad
        block_holding(p)
    hidden = index.config["hidden_size"]
    assert model.embed_tokens.weight.shape == (index.config["vocab_size"], hidden)
    assert block_holding(model.embed_tokens.weight) == 0
    assert block_holding(model.lm_head.weight) == N_BLOCKS - 1
    assert block_holding(model.layers[-1].mlp.down_proj.weight) == N_BLOCKS - 1
    assert model.layers[0].input_layernorm.weight.shape == (hidden,)
    # The rotary buffers are real (not meta) and were computed, not loaded.
    assert model.rotary_emb.inv_freq.device.type == "cpu"

    # A write into the block buffer is visible through the parameter: no copy was made.
    norm = model.layers[0].input_layernorm.weight
    entry = next(t for t in index.tensors if t.name == "model.layers.0.input_layernorm.weight")
    before = norm[0].item()
    blocks[0][entry.offset_in_block : entry.offset_in_block + 4].view(torch.float32)[0] = 123.0
    assert norm[0].item() == 123.0
    blocks[0][entry.offset_in_block : entry.offset_in_block + 4].view(torch.float32)[0] = before


def test_stage_holds_only_its_blocks(loaded):
    index, blocks = loaded
    middle = LayerRange(index, {1: blocks[1]}, 1, 2)  # only block 1 is needed
    assert middle.embed_tokens is None and middle.lm_head is None and middle.norm is None
    assert (middle.layer_start, middle.layer_end) == (2, 3)
    assert [layer.self_attn.layer_idx for layer in middle.layers] == [2]  # global layer index
    params = sum(p.numel() * p.element_size() for p in middle.parameters())
    assert params <= blocks[1].numel()

    cache = middle.new_cache()
    hidden = torch.randn(1, 5, index.config["hidden_size"])
    out = middle(hidden, cache)
    assert out.shape == hidden.shape
    assert cache.get_seq_length(2) == 5
    assert all(cache.get_seq_length(i) == 0 for i in (0, 1, 3))

    with pytest.raises(ValueError, match="not given"):
        LayerRange(index, {1: blocks[1]}, 0, 2)
    with pytest.raises(ValueError, match="invalid block range"):
        LayerRange(index, blocks, 2, 2)
    with pytest.raises(TypeError, match="token ids"):
        LayerRange(index, {0: blocks[0]}, 0, 1)(hidden, cache)


# -- exact equality with Hugging Face -------------------------------------------------------


def test_full_range_logits_equal_hf(loaded, ref):
    index, blocks = loaded
    model = LayerRange(index, blocks)
    want = hf_logits(ref, PROMPT, DECODE)
    got = run_stages([model], PROMPT, DECODE)
    for w, g in zip(want, got):
        assert torch.equal(g, w)  # bitwise, fp32


@pytest.mark.parametrize("split", [[(0, 1), (1, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]])
def test_staged_logits_equal_hf(loaded, ref, split):
    index, blocks = loaded
    stages = [LayerRange(index, {b: blocks[b] for b in range(s, e)}, s, e) for s, e in split]
    want = hf_logits(ref, PROMPT, DECODE)
    got = run_stages(stages, PROMPT, DECODE)
    for w, g in zip(want, got):
        assert torch.equal(g, w)


def test_tied_sharded_bf16_checkpoint_matches_hf(tmp_path):
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    convert_checkpoint(tmp_path / "hf", tmp_path / "blocks", 2)
    index, blocks = load_all(tmp_path / "blocks")

    ref = reference_model(tmp_path / "hf")
    assert ref.dtype == torch.bfloat16
    stages = [LayerRange(index, {0: blocks[0]}, 0, 1), LayerRange(index, {1: blocks[1]}, 1, 2)]
    assert stages[1].lm_head.weight.dtype == torch.bfloat16
    prompt, decode = [t % 256 for t in PROMPT], [t % 256 for t in DECODE]
    want = hf_logits(ref, prompt, decode)
    got = run_stages(stages, prompt, decode)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_sliding_window_models_match_hf(tmp_path, model_type):
    """Mistral-style sliding attention, and Qwen2 with full and sliding layers mixed (window < prompt)."""
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=False, sliding_window=4)
    if model_type == "mistral":
        config = MistralConfig(**common)
    else:
        config = Qwen2Config(**common, use_sliding_window=True, max_window_layers=2)
        assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "blocks", 3)
    index, blocks = load_all(tmp_path / "blocks")
    want = hf_logits(reference_model(tmp_path / "hf"), PROMPT, DECODE)
    for split in [[(0, 3)], [(0, 1), (1, 2), (2, 3)]]:
        got = run_stages([LayerRange(index, blocks, s, e) for s, e in split], PROMPT, DECODE)
        for w, g in zip(want, got):
            assert torch.equal(g, w)


# -- engine ---------------------------------------------------------------------------------


def drain(engine: Engine, max_steps: int = 1000) -> dict[str, list]:
    """Step until idle; outputs grouped by request id."""
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def engine(block_dir):
    return Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=256)


def test_greedy_decode_matches_hf_generate(engine, ref, hf_dir):
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [
        tok("The quick brown fox")["input_ids"],
        tok("Serverless inference scales out when a burst arrives.")["input_ids"],
        tok.apply_chat_template([{"role": "user", "content": "Write a poem about the sea."}],
                                tokenize=False, add_generation_prompt=True),
        [1, 2, 3],
    ]
    prompts[2] = tok(prompts[2], add_special_tokens=False)["input_ids"]
    max_new = 12
    for i, p in enumerate(prompts):  # all requests run concurrently in the engine
        engine.add_request(f"r{i}", p, SamplingSpec(temperature=0, max_tokens=max_new))
    results = drain(engine)

    eos = set(ref.generation_config.eos_token_id)
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            want = ref.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False, max_new_tokens=max_new,
            )[0, len(p):].tolist()
        outs = results[f"r{i}"]
        assert [o.token_id for o in outs] == want
        assert [o.completion_tokens for o in outs] == list(range(1, len(want) + 1))
        assert all(o.prompt_tokens == len(p) for o in outs)
        assert all(not o.finished for o in outs[:-1]) and outs[-1].finished
        assert outs[-1].finish_reason == ("stop" if want[-1] in eos else "length")


def test_seeded_sampling_is_reproducible(engine):
    def sample(seed, **kw):
        engine.add_request("s", PROMPT, SamplingSpec(temperature=1.0, max_tokens=16, seed=seed, **kw))
        return [o.token_id for o in drain(engine)["s"]]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(3, top_p=0.5) == sample(3, top_p=0.5)

    # Per-request generators: concurrent requests with the same seed do not disturb each other.
    for rid in ("a", "b"):
        engine.add_request(rid, PROMPT, SamplingSpec(temperature=0.8, max_tokens=10, seed=11))
    out = drain(engine)
    assert [o.token_id for o in out["a"]] == [o.token_id for o in out["b"]]


def test_finish_reasons(block_dir):
    engine = Engine.from_checkpoint(block_dir, eos_token_ids=())  # no eos: only our stop ids end a request
    engine.add_request("len", PROMPT, SamplingSpec(temperature=0, max_tokens=6))
    outs = drain(engine)["len"]
    tokens = [o.token_id for o in outs]
    assert len(outs) == 6 and outs[-1].finish_reason == "length" and outs[-1].completion_tokens == 6
    assert [o.finish_reason for o in outs[:-1]] == [None] * 5

    stop = tokens[3]
    engine.add_request("stop", PROMPT, SamplingSpec(temperature=0, max_tokens=6, stop_token_ids=(stop,)))
    outs = drain(engine)["stop"]
    expected_len = tokens.index(stop) + 1
    assert [o.token_id for o in outs] == tokens[:expected_len]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"

    # eos of the model also stops (with reason "stop").
    eos_engine = Engine.from_checkpoint(block_dir, eos_token_ids=(tokens[0],))
    eos_engine.add_request("eos", PROMPT, SamplingSpec(temperature=0, max_tokens=6))
    outs = drain(eos_engine)["eos"]
    assert len(outs) == 1 and outs[0].finish_reason == "stop"


def test_eos_ids_come_from_config_and_generation_config(engine, ref):
    assert engine.eos_token_ids == set(ref.generation_config.eos_token_id) | {ref.config.eos_token_id}


def test_cancel(engine):
    engine.add_request("keep", PROMPT, SamplingSpec(temperature=0, max_tokens=5))
    engine.add_request("drop", PROMPT, SamplingSpec(temperature=0, max_tokens=5))
    engine.add_request("never", PROMPT, SamplingSpec(temperature=0, max_tokens=5))
    assert engine.cancel("never")  # cancelled before its prefill
    first = engine.step()
    assert sorted(o.request_id for o in first) == ["drop", "keep"]
    assert engine.cancel("drop")
    assert not engine.cancel("drop") and not engine.cancel("unknown")
    rest = drain(engine)
    assert list(rest) == ["keep"] and len(rest["keep"]) == 4
    assert not engine.has_work()


def test_admission(block_dir, engine):
    small = Engine.from_checkpoint(block_dir, max_batch_size=2, max_seq_len=32, max_queue=1)
    with pytest.raises(AdmissionError, match="max_seq_len"):
        small.add_request("long", list(range(1, 30)), SamplingSpec(max_tokens=4))
    small.add_request("ok", list(range(1, 29)), SamplingSpec(max_tokens=4))  # exactly 32
    small.add_request("ok2", [1], SamplingSpec(max_tokens=4))
    small.add_request("queued", [1], SamplingSpec(max_tokens=4))  # waits for a KV slot
    with pytest.raises(AdmissionError, match="full"):
        small.add_request("fourth", [1], SamplingSpec(max_tokens=4))
    with pytest.raises(ValueError, match="already"):
        small.add_request("ok", [1], SamplingSpec())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingSpec())
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("v", [1, 10_000], SamplingSpec())
    assert set(drain(small)) == {"ok", "ok2", "queued"}
    assert not engine.has_work()


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(max_tokens=2.0),
     dict(seed="x"), dict(stop_token_ids=(-1,)), dict(temperature=float("nan"))],
)
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingSpec(**kwargs)


def test_sampling_params_normalises_stop_ids():
    assert SamplingSpec(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingSpec(temperature=0).greedy


def test_from_checkpoint_index(block_dir, engine):
    assert isinstance(engine.index, CheckpointIndex)
    assert engine.model.has_embedding and engine.model.has_head
    assert engine.free_slots == engine.max_batch_size


# -- serving while the blocks are still arriving ------------------------------------------------------


class _Arriving:
    """A BlockSource whose blocks arrive when the test releases them (a LoadJob's contract)."""

    def __init__(self, blocks, fail_at=None):
        self.blocks, self.fail_at = blocks, fail_at
        self.released = {b: threading.Event() for b in blocks}
        self.waited: list[int] = []

    def wait(self, block_id, timeout=None):
        self.waited.append(block_id)
        if not self.released[block_id].wait(10):
            raise TimeoutError(f"block {block_id} never arrived")
        if block_id == self.fail_at:
            raise ValueError(f"block {block_id}: checksum mismatch")
        return self.blocks[block_id]


def test_a_range_over_arriving_blocks_runs_early_layers_first_and_matches_hf(loaded, ref):
    index, blocks = loaded
    source = _Arriving(blocks)
    model = LayerRange(index, source, device="cpu")  # built before any block is there
    assert not model.complete and source.waited == []
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=run_stages([model], PROMPT, DECODE)))
    runner.start()
    for b in range(N_BLOCKS):  # release one block at a time: the forward pass asks for them in order
        deadline = time.monotonic() + 10
        while b not in source.waited and time.monotonic() < deadline:
            time.sleep(0.005)
        assert source.waited == list(range(b + 1))
        source.released[b].set()
    runner.join(10)
    assert model.complete and source.waited == list(range(N_BLOCKS))
    for w, g in zip(hf_logits(ref, PROMPT, DECODE), result["out"]):
        assert torch.equal(g, w)  # bitwise, as with every block present up front


def test_engine_over_a_live_load_job_matches_the_engine_over_loaded_blocks(block_dir, engine):
    from libs.checkpoint.fastload import BlockLoader, LoaderConfig

    index = CheckpointIndex.load(block_dir)
    job = BlockLoader("cpu", LoaderConfig(chunk_bytes=4096, threads=2)).start(block_dir, index)
    live = Engine(index, job, device="cpu", max_batch_size=4, max_seq_len=256)
    for e in (live, engine):
        e.add_request("same", PROMPT, SamplingSpec(temperature=0, max_tokens=8))
    assert [o.token_id for o in drain(live)["same"]] == [o.token_id for o in drain(engine)["same"]]
    assert live.model.complete


def test_a_block_that_fails_to_arrive_fails_the_forward_pass_not_silently(loaded):
    index, blocks = loaded
    source = _Arriving(blocks, fail_at=1)
    for ev in source.released.values():
        ev.set()
    model = LayerRange(index, source, device="cpu")
    with pytest.raises(ValueError, match="checksum"):
        model(torch.tensor([PROMPT]), model.new_cache())
    assert not model.complete


def test_arriving_blocks_need_an_explicit_device(loaded):
    index, blocks = loaded
    with pytest.raises(ValueError, match="device"):
        LayerRange(index, _Arriving(blocks))


def test_warm_up_builds_a_skeleton_of_every_supported_model_type():
    """A worker warms up at start; it must work for each type the engine serves (and only on meta)."""
    warm_up()
    warm_up(SUPPORTED_MODEL_TYPES[:1])
    with pytest.raises(KeyError):
        warm_up(("no-such-type",))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_a_cpu_kv_cache_costs_memory_only_as_its_slots_fill():
    """An engine (or a pipeline stage formed mid-scale-out) starts without writing its whole KV
    budget: the cache is zero, but its pages come to exist only when first written."""
    from libs.engine.kv import SlotKVCache

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8)
    before = _rss_bytes()
    cache = SlotKVCache(config, 0, 8, slots=16, max_seq_len=4096, device=torch.device("cpu"), dtype=torch.float32)
    assert cache.nbytes == 1 << 30
    assert _rss_bytes() - before < 64 << 20  # not the 1 GiB of the budget
    assert all(float(t[:, :, :64].abs().sum()) == 0.0 for t in (*cache.keys, *cache.values))
    cache.keys[0][3, :, :100] = 1.0  # a slot that fills takes memory, and keeps what was written
    assert float(cache.keys[0].sum()) == 4 * 100 * 64


def test_waiting_prompts_are_prefilled_together_and_decode_as_if_alone(block_dir):
    """A burst's prompts go through in batched passes (a step's pass takes the next n tokens of
    every waiting prompt, n the shortest remainder), and each request's tokens equal those it
    gets running alone."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24, 25]]
    params = SamplingSpec(temperature=0, max_tokens=6)
    alone = {}
    for i, p in enumerate(prompts):
        solo = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64)
        solo.add_request("x", p, params)
        alone[i] = [o.token_id for o in drain(solo)["x"]]
    together = Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64)
    calls: list[tuple[int, int]] = []
    forward = together._forward

    def counted(ids, inputs, q_len):
        calls.append((len(ids), q_len))
        return forward(ids, inputs, q_len)

    together._forward = counted
    for i, p in enumerate(prompts):
        together.add_request(f"r{i}", p, params)
    first = together.step()
    assert calls == [(4, 4)]  # one pass: the first 4 tokens of all four rows
    assert sorted(o.request_id for o in first) == ["r0", "r1"]  # their prompts are in
    second = together.step()
    assert calls[1:] == [(2, 1), (2, 2)]  # r0 and r1 decode; the next 2 of r2 and r3 in one pass
    results = drain(together)
    for i in range(len(prompts)):
        assert [o.token_id for o in first + second if o.request_id == f"r{i}"] + \
            [o.token_id for o in results[f"r{i}"]] == alone[i]
