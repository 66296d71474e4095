"""libs.checkpoint: demo checkpoints, conversion to the block format, block loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest_models import N_BLOCKS, arch, block_dir, hf_dir, load_all  # noqa: F401  (fixtures)
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from libs.checkpoint import (
    BLOCK_ALIGN,
    DATA_FILE,
    INDEX_FILE,
    TENSOR_ALIGN,
    CheckpointIndex,
    ChecksumError,
    block_tensors,
    convert_checkpoint,
    create_demo_checkpoint,
    is_block_checkpoint,
    load_block,
    split_layers,
)
from libs.checkpoint.demo import PRESETS, demo_config


def hf_tensors(hf_dir):
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


# -- demo checkpoints -----------------------------------------------------------------------


def test_demo_checkpoint_loads_with_transformers(hf_dir, arch):
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.config.model_type == arch
    assert model.config.tie_word_embeddings is False
    assert model.config.max_position_embeddings >= 2048
    assert model.dtype == torch.float32

    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert len(tok) <= model.config.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        model.config.bos_token_id,
        model.config.eos_token_id,
        model.config.pad_token_id,
    )
    text = "Hello, world! Serverless inference scales out quickly. Ünïcode ✓"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Whatever class AutoTokenizer picks for this model_type, it tokenizes like tokenizer.json.
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert raw.encode(text).ids == ids

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    chat_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in chat_ids
    with torch.inference_mode():
        logits = model(torch.tensor([chat_ids])).logits
    assert logits.shape == (1, len(chat_ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_demo_checkpoint_is_seeded(tmp_path, hf_dir, arch):
    same = create_demo_checkpoint(tmp_path / "same", arch=arch, seed=0)
    other = create_demo_checkpoint(tmp_path / "other", arch=arch, seed=1)
    a, b, c = hf_tensors(hf_dir), hf_tensors(same), hf_tensors(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_sizes(preset):
    config = demo_config(preset, "llama")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    expected = {"tiny": (50e3, 1e6), "small": (5e6, 20e6), "small-40k": (25e6, 30e6), "100m": (80e6, 120e6), "200m": (180e6, 260e6),
                "1b": (1.0e9, 1.2e9)}[preset]
    assert expected[0] <= n_params <= expected[1]
    assert config.max_position_embeddings >= 2048


def test_demo_rejects_unknown_preset_or_arch(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        create_demo_checkpoint(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="arch"):
        create_demo_checkpoint(tmp_path, arch="gpt2")


# -- conversion -----------------------------------------------------------------------------


def test_convert_layout_and_index(hf_dir, block_dir):
    index = CheckpointIndex.load(block_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    assert index.format_version == 1
    assert index.config == config
    assert index.model_type == config["model_type"]
    assert index.arch == config["architectures"][0]
    assert index.n_layers == config["num_hidden_layers"] == 4
    assert index.n_blocks == N_BLOCKS

    # Blocks: page aligned, in order, non-overlapping, inside the file.
    file_size = (block_dir / DATA_FILE).stat().st_size
    end = 0
    for i, b in enumerate(index.blocks):
        assert b.id == i
        assert b.offset % BLOCK_ALIGN == 0 and b.offset >= end
        assert b.nbytes % TENSOR_ALIGN == 0
        end = b.offset + b.nbytes
    assert end <= file_size

    # Layer ranges partition [0, n_layers), as evenly as possible.
    assert [(b.layer_start, b.layer_end) for b in index.blocks] == [(0, 2), (2, 3), (3, 4)]
    assert [b.has_embedding for b in index.blocks] == [True, False, False]
    assert [b.has_head for b in index.blocks] == [False, False, True]

    # Tensors: every HF tensor exactly once, 64-byte aligned, non-overlapping, in the right block.
    original = hf_tensors(hf_dir)
    names = [t.name for t in index.tensors]
    assert len(names) == len(set(names))
    assert set(names) == set(original)
    for b in index.blocks:
        spans = sorted((t.offset_in_block, t.offset_in_block + t.nbytes) for t in index.tensors_in_block(b.id))
        for (s0, e0), (s1, _) in zip(spans, spans[1:]):
            assert e0 <= s1
        assert all(s % TENSOR_ALIGN == 0 and e <= b.nbytes for s, e in spans)
    for t in index.tensors:
        assert t.shape == list(original[t.name].shape)
        assert t.nbytes == original[t.name].numel() * original[t.name].element_size()
        if t.name.startswith("model.layers."):
            layer = int(t.name.split(".")[2])
            assert t.block == index.block_of_layer(layer)
    by_name = {t.name: t for t in index.tensors}
    assert by_name["model.embed_tokens.weight"].block == 0
    assert by_name["model.norm.weight"].block == by_name["lm_head.weight"].block == N_BLOCKS - 1

    # The bytes are the original tensors.
    for b in index.blocks:
        for name, view in block_tensors(index, b.id, load_block(block_dir, index, b.id)).items():
            assert torch.equal(view, original[name]), name

    # Side files make the folder servable on its own.
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (block_dir / name).is_file(), name
    assert not list(block_dir.glob("*.safetensors"))
    tok = AutoTokenizer.from_pretrained(block_dir)
    assert tok.decode(tok("round trip")["input_ids"], skip_special_tokens=True) == "round trip"

    assert is_block_checkpoint(block_dir)
    assert not is_block_checkpoint(hf_dir)


def test_index_round_trip(block_dir, tmp_path):
    index = CheckpointIndex.load(block_dir)
    index.save(tmp_path)
    assert CheckpointIndex.load(tmp_path) == index
    data = json.loads((tmp_path / INDEX_FILE).read_text())
    data["format_version"] = 99
    (tmp_path / INDEX_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format_version"):
        CheckpointIndex.load(tmp_path)


@pytest.mark.parametrize("n_blocks", [1, 2, 4])
def test_convert_other_block_counts(hf_dir, tmp_path, n_blocks):
    index = convert_checkpoint(hf_dir, tmp_path, n_blocks)
    assert index.n_blocks == n_blocks
    assert index.blocks[0].layer_start == 0 and index.blocks[-1].layer_end == 4
    assert all(a.layer_end == b.layer_start for a, b in zip(index.blocks, index.blocks[1:]))
    assert index.blocks[0].has_embedding and index.blocks[-1].has_head
    assert len(index.tensors) == len(hf_tensors(hf_dir))


@pytest.mark.parametrize("n_blocks", [0, -1, 5, 2.5, True, "2"])
def test_convert_rejects_bad_block_count(hf_dir, tmp_path, n_blocks):
    with pytest.raises(ValueError, match="n_blocks"):
        convert_checkpoint(hf_dir, tmp_path, n_blocks)


@pytest.mark.parametrize("n_layers,n_blocks", [(4, 3), (7, 3), (32, 16), (32, 5), (10, 10), (1, 1)])
def test_split_layers_is_even(n_layers, n_blocks):
    ranges = split_layers(n_layers, n_blocks)
    sizes = [e - s for s, e in ranges]
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_convert_sharded_tied_bf16(tmp_path):
    """Sharded safetensors with index.json, tied embeddings, bfloat16."""
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    hf = tmp_path / "hf"
    model.save_pretrained(hf, max_shard_size="60KB")
    assert (hf / "model.safetensors.index.json").is_file()
    assert len(list(hf.glob("model-*.safetensors"))) > 1
    original = hf_tensors(hf)
    assert "lm_head.weight" not in original  # tied: saved once

    index = convert_checkpoint(hf, tmp_path / "blocks", 2)
    _, blocks = load_all(tmp_path / "blocks")
    last = block_tensors(index, 1, blocks[1])
    first = block_tensors(index, 0, blocks[0])
    assert last["lm_head.weight"].dtype == torch.bfloat16
    # The head gets its own copy in the last block, so a stage holding only that block is complete.
    assert torch.equal(last["lm_head.weight"], first["model.embed_tokens.weight"])
    assert {t.name for t in index.tensors} == set(original) | {"lm_head.weight"}
    for name, t in {**first, **last}.items():
        if name != "lm_head.weight":
            assert torch.equal(t, original[name])


def test_convert_rejects_unknown_tensors(hf_dir, tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    shutil.copytree(hf_dir, hf)
    tensors = hf_tensors(hf_dir)
    tensors["vision_tower.proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, hf / "model.safetensors")
    with pytest.raises(ValueError, match="vision_tower"):
        convert_checkpoint(hf, tmp_path / "out", 2)


# -- loading --------------------------------------------------------------------------------


def test_load_block_into_preallocated_buffer(block_dir):
    index = CheckpointIndex.load(block_dir)
    entry = index.blocks[1]
    out = torch.zeros(entry.nbytes + 100, dtype=torch.uint8)
    buf = load_block(block_dir, index, 1, out=out)
    assert buf.numel() == entry.nbytes
    assert buf.data_ptr() == out.data_ptr()  # filled in place, no copy
    assert torch.equal(buf, load_block(block_dir, index, 1))
    with pytest.raises(ValueError, match="needs"):
        load_block(block_dir, index, 1, out=torch.empty(entry.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(IndexError):
        load_block(block_dir, index, N_BLOCKS)


def test_block_tensors_are_views(block_dir):
    index = CheckpointIndex.load(block_dir)
    buf = load_block(block_dir, index, 0)
    views = block_tensors(index, 0, buf)
    emb = views["model.embed_tokens.weight"]
    entry = next(t for t in index.tensors if t.name == "model.embed_tokens.weight")
    assert emb.data_ptr() == buf.data_ptr() + entry.offset_in_block
    assert emb.shape == (512, 64)
    buf[entry.offset_in_block : entry.offset_in_block + 4] = torch.tensor([0, 0, 128, 63], dtype=torch.uint8)
    assert emb[0, 0].item() == 1.0  # writes to the buffer show through the view


def test_corrupted_block_raises_checksum_error(block_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(block_dir, bad)
    index = CheckpointIndex.load(bad)
    target = index.blocks[1]
    with open(bad / DATA_FILE, "r+b") as f:
        f.seek(target.offset + target.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="block 1") as err:
        load_block(bad, index, 1)
    assert err.value.block_id == 1
    assert str(bad / DATA_FILE) in str(err.value)
    assert isinstance(err.value, ValueError)
    # Other blocks are untouched.
    load_block(bad, index, 0)
    load_block(bad, index, 2)
