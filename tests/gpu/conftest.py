"""The `gpu` tests: every CUDA branch of layercast, run on the device LAYERCAST_GPU_DEVICE names.

By default that is `cuda`, and every test here is skipped (with a reason naming CUDA) where
torch.cuda.is_available() is false. `scripts/gpu-check --dry` sets LAYERCAST_GPU_DEVICE=cpu:
the same test bodies then run on the CPU, so the check itself is exercised in CI. (An env var,
not a pytest option: options of a conftest below the rootdir exist only when its folder is
named on the command line, and `pytest -m gpu` names none.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest_models import arch, block_dir, hf_dir  # noqa: F401  (fixtures: tiny Llama and Qwen2 demo models)

DEVICE_ENV = "LAYERCAST_GPU_DEVICE"
HERE = Path(__file__).parent


def target_device() -> torch.device:
    return torch.device(os.environ.get(DEVICE_ENV, "cuda"))


def cuda_missing_reason() -> str | None:
    device = target_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        return (f"CUDA is not available (torch.cuda.is_available() is false); {DEVICE_ENV}=cpu runs these "
                "tests on the CPU (scripts/gpu-check --dry)")
    return None


def pytest_collection_modifyitems(config, items):
    reason = cuda_missing_reason()
    for item in items:
        # test_gpu_check.py's tests are not marked gpu: they check the check itself, in CI.
        if reason and HERE in Path(str(item.path)).parents and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return target_device()


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory) -> Path:
    """The small demo Llama (about 28 MB, fp32) in 4 blocks: enough chunks for the loader's pipeline."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint

    root = tmp_path_factory.mktemp("gpu-small")
    hf = create_demo_checkpoint(root / "hf", preset="small", arch="llama", seed=0)
    convert_checkpoint(hf, root / "blocks", 4)
    return root / "blocks"
