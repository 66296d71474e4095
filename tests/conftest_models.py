"""Shared fixtures and helpers for checkpoint/engine tests: tiny demo checkpoints built locally.

Test modules import the fixtures they use (`from conftest_models import arch, hf_dir, ...`);
fixtures are session-scoped per importing module, so each module builds its checkpoints once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from libs.checkpoint import CheckpointIndex, convert_checkpoint, create_demo_checkpoint, load_block

ARCHS = ("llama", "qwen2")
N_BLOCKS = 3  # the tiny preset has 4 layers: blocks of 2, 1, 1 layers

transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="session", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, arch) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp(f"hf-{arch}"), preset="tiny", arch=arch, seed=0)


@pytest.fixture(scope="session")
def block_dir(tmp_path_factory, hf_dir, arch) -> Path:
    out = tmp_path_factory.mktemp(f"blocks-{arch}")
    convert_checkpoint(hf_dir, out, N_BLOCKS)
    return out


def load_all(ckpt_dir: Path) -> tuple[CheckpointIndex, dict[int, torch.Tensor]]:
    index = CheckpointIndex.load(ckpt_dir)
    return index, {b.id: load_block(ckpt_dir, index, b.id) for b in index.blocks}


def reference_model(hf_dir: Path):
    """The Hugging Face model, with parameters in fresh (64-byte aligned) memory.

    from_pretrained leaves parameters as views into the mmapped safetensors file, at
    offsets that are not 64-byte aligned; CPU GEMV kernels round differently depending on
    alignment, so one-token decode steps would differ from the (aligned) block buffers in
    the last ulp. Re-materialising makes the reference comparable bit for bit.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def two_tiny_llamas(root: Path) -> dict[str, Path]:
    """Two different tiny Llama models ("alpha", "beta") in 2 blocks each: two models sharing
    one worker (mesh memory tests, on the CPU and on a GPU)."""
    out = {}
    for name, seed in (("alpha", 0), ("beta", 1)):
        hf = create_demo_checkpoint(root / name / "hf", preset="tiny", arch="llama", seed=seed)
        convert_checkpoint(hf, root / name / "blocks", 2)
        out[name] = root / name / "blocks"
    return out


def drain_tokens(engine, out: dict[str, list[int]] | None = None, max_steps: int = 2000) -> dict[str, list[int]]:
    """Step an engine until it is idle: each request's token ids, appended to `out` (holding the
    tokens a test already took from it, if any)."""
    out = {} if out is None else out
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
    raise AssertionError("engine did not finish")
