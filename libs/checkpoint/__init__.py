"""Block-packed checkpoint format: demo checkpoints, conversion from Hugging Face, block loading."""

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

__all__ = [
    "BLOCK_ALIGN",
    "DATA_FILE",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "TENSOR_ALIGN",
    "BlockEntry",
    "CheckpointFormatError",
    "CheckpointIndex",
    "ChecksumError",
    "TensorEntry",
    "allocate_block",
    "block_tensors",
    "convert_checkpoint",
    "create_demo_checkpoint",
    "is_block_checkpoint",
    "load_block",
    "split_layers",
    "verify_block",
]
