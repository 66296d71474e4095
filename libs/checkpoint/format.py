"""Block checkpoint format (version 1): index dataclasses and constants.

A block checkpoint folder holds:
  blocks.bin              every block as one contiguous region at a BLOCK_ALIGN-aligned offset
  layercast_index.json    CheckpointIndex: where each block and tensor lives, checksums, the HF config
  config.json, tokenizer files, ...   copied from the Hugging Face folder so the folder alone is servable
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1
INDEX_FILE = "layercast_index.json"
DATA_FILE = "blocks.bin"
# Block regions start on a page boundary so they can later be read with O_DIRECT
# and registered as RDMA memory regions without copying.
BLOCK_ALIGN = 4096
# Tensors start on a 64-byte boundary (cache line; enough for any dtype view and SIMD loads).
TENSOR_ALIGN = 64

# safetensors dtype codes -> torch dtype names (the index stores torch names).
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass
class TensorEntry:
    name: str  # Hugging Face parameter name, e.g. "model.layers.3.mlp.up_proj.weight"
    block: int
    offset_in_block: int
    nbytes: int
    shape: list[int]
    dtype: str  # torch dtype name, e.g. "bfloat16"


@dataclass
class BlockEntry:
    id: int
    offset: int  # byte offset of the block region in blocks.bin
    nbytes: int  # size of the region (tensors and the padding between them)
    checksum: str  # zlib.crc32 of the region, 8 hex digits
    layer_start: int  # decoder layers [layer_start, layer_end) live in this block
    layer_end: int
    has_embedding: bool
    has_head: bool  # final norm + lm_head


@dataclass
class CheckpointIndex:
    arch: str  # HF architecture class name, e.g. "LlamaForCausalLM"
    model_type: str
    n_layers: int
    config: dict[str, Any]  # the full HF config.json
    blocks: list[BlockEntry]
    tensors: list[TensorEntry]
    data_file: str = DATA_FILE
    format_version: int = FORMAT_VERSION
    block_align: int = BLOCK_ALIGN
    tensor_align: int = TENSOR_ALIGN
    _by_block: dict[int, list[TensorEntry]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def total_nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def block(self, block_id: int) -> BlockEntry:
        if not 0 <= block_id < len(self.blocks):
            raise IndexError(f"block {block_id} out of range (checkpoint has {len(self.blocks)} blocks)")
        return self.blocks[block_id]

    def tensors_in_block(self, block_id: int) -> list[TensorEntry]:
        if self._by_block is None:
            by_block: dict[int, list[TensorEntry]] = {b.id: [] for b in self.blocks}
            for t in self.tensors:
                by_block[t.block].append(t)
            self._by_block = by_block
        self.block(block_id)
        return self._by_block[block_id]

    def block_of_layer(self, layer: int) -> int:
        for b in self.blocks:
            if b.layer_start <= layer < b.layer_end:
                return b.id
        raise IndexError(f"layer {layer} out of range (model has {self.n_layers} layers)")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_by_block")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointIndex:
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported block checkpoint format_version {version!r} (expected {FORMAT_VERSION})")
        d = dict(d)
        d["blocks"] = [BlockEntry(**b) for b in d["blocks"]]
        d["tensors"] = [TensorEntry(**t) for t in d["tensors"]]
        return cls(**d)

    def save(self, ckpt_dir: str | os.PathLike) -> Path:
        path = Path(ckpt_dir) / INDEX_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        # Atomic rename: a reader never sees a half-written index (the index marks the folder complete).
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, ckpt_dir: str | os.PathLike) -> CheckpointIndex:
        path = Path(ckpt_dir) / INDEX_FILE
        return cls.from_dict(json.loads(path.read_text()))


def is_block_checkpoint(ckpt_dir: str | os.PathLike) -> bool:
    d = Path(ckpt_dir)
    return (d / INDEX_FILE).is_file() and (d / DATA_FILE).is_file()
