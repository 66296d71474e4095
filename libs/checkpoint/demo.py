"""Demo checkpoints built entirely offline: seeded random Llama/Qwen2 weights plus a small BPE tokenizer.

They are Hugging Face-style folders (config.json, model.safetensors, tokenizer files) that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load, and that
`convert_checkpoint` packs into blocks like any real checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4, in this order

# Qwen2/Llama-3 style pre-tokenization. transformers 5.x's AutoTokenizer ignores tokenizer_class
# for model_type "qwen2" and rebuilds the pipeline as Qwen2Tokenizer (this regex + NFC, unk
# "<|endoftext|>"); building the tokenizer that way for every arch keeps both loaders identical.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML turns; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MAX_POSITIONS = 4096

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, dtype="float32"),
    "small": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=2048, dtype="float32"),
    # The small model's layers with a 40k vocabulary: ~107 MB in fp32, most of it embeddings (as
    # in Qwen2-0.5B, a quarter of whose weights are), so it loads like a 100 MB model and serves
    # almost as cheaply as `small` (the trace benchmark on 2 cores).
    "small-40k": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=688, vocab_size=40960, dtype="float32"),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2304, vocab_size=8192, dtype="bfloat16"),
    # ~440 MB in bf16: big enough for load benchmarks to measure the disk, not Python.
    "200m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=2816, vocab_size=16384, dtype="bfloat16"),
    # TinyLlama-1.1B's shape, ~2.2 GB in bf16: a load benchmark on a GPU machine measures the PCIe
    # path with it, not a cache (scripts/gpu-check).
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000, dtype="bfloat16"),
}

# Small built-in English corpus for training the tokenizer (no downloads).
CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Large language models generate text one token at a time. Each token is predicted from the tokens before it.
Serverless inference scales a model out when requests arrive and back to zero when the system is idle.
Workers load model blocks from memory, from local disks, or from each other over the network.
When a burst of requests arrives, the platform multicasts blocks between workers so that new instances start quickly.
A pipeline of partially loaded workers can serve requests before any single worker holds the whole model.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Please write a short poem about the sea. The waves roll in, the waves roll out, the gulls call over the sand.
Once upon a time there was a little robot who wanted to learn how to paint the sky at sunset.
The weather today is sunny with a light breeze from the west, and the temperature will reach twenty degrees.
Numbers: zero, one, two, three, four, five, six, seven, eight, nine, ten, 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Questions and answers help people learn. Why is the sky blue? Because air scatters blue light more than red light.
The user asked the assistant for help, and the assistant answered the question clearly and politely.
Cats and dogs are common pets. Birds sing in the morning. Trees grow slowly, and rivers run to the sea.
Good morning, good afternoon, good evening, and good night. See you tomorrow, my friend.
"""


def build_tokenizer(vocab_size: int):
    """A byte-level BPE (any text encodes; decode round-trips) wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def demo_config(preset: str = "tiny", arch: str = "llama"):
    from transformers import LlamaConfig, Qwen2Config

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}.get(arch)
    if config_cls is None:
        raise ValueError(f"unknown arch {arch!r}; choose 'llama' or 'qwen2'")
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    return config_cls(
        **PRESETS[preset],
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        pad_token_id=ids[PAD],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]],
    )


def create_demo_checkpoint(out_dir: str | os.PathLike, preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Write a seeded random Hugging Face checkpoint (weights, config, tokenizer) to out_dir."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    config = demo_config(preset, arch)
    dtype = getattr(torch, PRESETS[preset]["dtype"])
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG state
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        # End of text, or the end of an assistant turn in chat.
        eos_token_id=[config.eos_token_id, SPECIAL_TOKENS.index(IM_END)],
        pad_token_id=config.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    # from_config leaves dtype unset; record the real one so loaders do not guess.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = PRESETS[preset]["dtype"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out
