"""Block-packed checkpoint format: demo checkpoints, conversion from Hugging Face, block loading.

The names load their submodule on first use (PEP 562): reading an index (`.format`) needs no
torch, and a process that only reads indexes (the gateway) must not pay torch's import at start."""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .convert import convert_checkpoint, split_layers
    from .demo import create_demo_checkpoint
    from .format import (
        BLOCK_ALIGN,
        DATA_FILE,
        FORMAT_VERSION,
        INDEX_FILE,
        TENSOR_ALIGN,
        BlockEntry,
        CheckpointFormatError,
        CheckpointIndex,
        TensorEntry,
        is_block_checkpoint,
    )
    from .loader import ChecksumError, allocate_block, block_tensors, load_block, verify_block

_SUBMODULE = {
    "convert_checkpoint": "convert", "split_layers": "convert",
    "create_demo_checkpoint": "demo",
    **dict.fromkeys(["BLOCK_ALIGN", "DATA_FILE", "FORMAT_VERSION", "INDEX_FILE", "TENSOR_ALIGN", "BlockEntry",
                     "CheckpointFormatError", "CheckpointIndex", "TensorEntry", "is_block_checkpoint"], "format"),
    **dict.fromkeys(["ChecksumError", "allocate_block", "block_tensors", "load_block", "verify_block"], "loader"),
}

__all__ = sorted(_SUBMODULE)


def __getattr__(name: str):
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULE])
