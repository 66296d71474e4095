"""Block checkpoint format (version 1): index dataclasses and constants.

A block checkpoint folder holds:
  blocks.bin              every block as one contiguous region at a BLOCK_ALIGN-aligned offset
  layercast_index.json    CheckpointIndex: where each block and tensor lives, checksums, the HF config
  config.json, tokenizer files, ...   copied from the Hugging Face folder so the folder alone is servable
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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


class CheckpointFormatError(ValueError):
    """A checkpoint index that does not parse or does not describe a consistent block checkpoint."""


# Bytes per element of the torch dtypes an index may name: reading an index needs no torch (the
# gateway reads indexes, and importing torch would cost its restart seconds).
DTYPE_ITEMSIZES = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "complex128": 16, "cdouble": 16, "complex64": 8, "cfloat": 8, "complex32": 4, "chalf": 4,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the torch dtype `name`; ValueError for a name that is not one."""
    if type(name) is not str or name not in DTYPE_ITEMSIZES:
        raise ValueError(f"unknown dtype {name!r}")
    return DTYPE_ITEMSIZES[name]


def torch_dtype(name: str) -> torch.dtype:
    import torch

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
        """Parse and check an index: every field of its type, the blocks numbered 0..n-1 with their
        layers inside the model, each tensor inside its block and as large as its shape and dtype
        say; a CheckpointFormatError otherwise."""
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"a checkpoint index is a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"unsupported block checkpoint format_version {version!r} (expected {FORMAT_VERSION})")
        known = {f.name for f in fields(cls) if f.init}
        _fields_of(d, known, {"arch", "model_type", "n_layers", "config", "blocks", "tensors"}, "index")
        d = dict(d)
        for name in ("arch", "model_type", "data_file"):
            _typed(d, name, str, "index")
        n_layers = _count(d, "n_layers", "index")
        for name in ("block_align", "tensor_align"):
            if name in d and _count(d, name, "index") < 1:
                raise CheckpointFormatError(f"index: {name} must be positive")
        data_file = d.get("data_file", DATA_FILE)
        if not data_file or "/" in data_file or "\\" in data_file or data_file in (".", ".."):
            raise CheckpointFormatError(f"index: data_file {data_file!r} is not a file name in the checkpoint folder")
        _typed(d, "config", dict, "index")
        blocks = [_block(b, i, n_layers) for i, b in enumerate(_typed(d, "blocks", list, "index"))]
        d["blocks"] = blocks
        d["tensors"] = [_tensor(t, i, blocks) for i, t in enumerate(_typed(d, "tensors", list, "index"))]
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
        """The folder's index, checked (from_dict); where the folder holds its data file too, every
        block must lie inside it (no read or buffer of a size the file does not have)."""
        path = Path(ckpt_dir) / INDEX_FILE
        raw = path.read_bytes()
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
            raise CheckpointFormatError(f"{path} is not JSON: {e}") from None
        index = cls.from_dict(d)
        try:
            size = (Path(ckpt_dir) / index.data_file).stat().st_size
        except FileNotFoundError:
            return index  # an index alone (e.g. the gateway reads the config and tokenizer only)
        for b in index.blocks:
            if b.offset + b.nbytes > size:
                raise CheckpointFormatError(f"{path}: block {b.id} ends at byte {b.offset + b.nbytes}, past the "
                                            f"end of {index.data_file} ({size} bytes)")
        return index


def _typed(d: dict, name: str, kind: type, what: str) -> Any:
    value = d.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointFormatError(f"{what}: {name} must be {kind.__name__}, got {value!r:.80}")
    return value


def _count(d: dict, name: str, what: str) -> int:
    value = _typed(d, name, int, what)
    if value < 0:
        raise CheckpointFormatError(f"{what}: {name} must not be negative, got {value}")
    return value


def _fields_of(d: dict, known: set[str], required: set[str], what: str) -> None:
    if missing := required - set(d):
        raise CheckpointFormatError(f"{what}: missing {sorted(missing)}")
    if unknown := set(d) - known:
        raise CheckpointFormatError(f"{what}: unknown fields {sorted(unknown)[:5]}")


_BLOCK_FIELDS = {"id", "offset", "nbytes", "checksum", "layer_start", "layer_end", "has_embedding", "has_head"}
_TENSOR_FIELDS = {"name", "block", "offset_in_block", "nbytes", "shape", "dtype"}


def _block(b: Any, i: int, n_layers: int) -> BlockEntry:
    what = f"block {i}"
    if not isinstance(b, dict):
        raise CheckpointFormatError(f"{what} is not an object")
    _fields_of(b, _BLOCK_FIELDS, _BLOCK_FIELDS, what)
    if _count(b, "id", what) != i:
        raise CheckpointFormatError(f"{what}: id {b['id']}, blocks are numbered 0..n-1 in order")
    for name in ("offset", "nbytes"):
        _count(b, name, what)
    checksum = _typed(b, "checksum", str, what)
    if len(checksum) != 8 or any(c not in "0123456789abcdef" for c in checksum):
        raise CheckpointFormatError(f"{what}: checksum {checksum!r:.20} is not 8 hex digits")
    if not 0 <= _count(b, "layer_start", what) <= _count(b, "layer_end", what) <= n_layers:
        raise CheckpointFormatError(f"{what}: layers [{b['layer_start']}, {b['layer_end']}) are not inside the "
                                    f"model's {n_layers}")
    for name in ("has_embedding", "has_head"):
        _typed(b, name, bool, what)
    return BlockEntry(**b)


def _tensor(t: Any, i: int, blocks: list[BlockEntry]) -> TensorEntry:
    what = f"tensor {i}"
    if not isinstance(t, dict):
        raise CheckpointFormatError(f"{what} is not an object")
    _fields_of(t, _TENSOR_FIELDS, _TENSOR_FIELDS, what)
    _typed(t, "name", str, what)
    block = _count(t, "block", what)
    if block >= len(blocks):
        raise CheckpointFormatError(f"{what}: block {block} of {len(blocks)}")
    start, nbytes = _count(t, "offset_in_block", what), _count(t, "nbytes", what)
    if start + nbytes > blocks[block].nbytes:
        raise CheckpointFormatError(f"{what}: bytes [{start}, {start + nbytes}) are not inside block {block} "
                                    f"({blocks[block].nbytes} bytes)")
    shape = _typed(t, "shape", list, what)
    if not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointFormatError(f"{what}: shape {shape!r:.80} is not a list of sizes")
    try:
        itemsize = dtype_itemsize(_typed(t, "dtype", str, what))
    except ValueError as e:
        raise CheckpointFormatError(f"{what}: {e}") from None
    numel = 1
    for n in shape:
        numel *= n
    if numel * itemsize != nbytes:
        raise CheckpointFormatError(f"{what}: shape {shape} of {t['dtype']} is {numel * itemsize} bytes, not {nbytes}")
    return TensorEntry(**t)


def is_block_checkpoint(ckpt_dir: str | os.PathLike) -> bool:
    d = Path(ckpt_dir)
    return (d / INDEX_FILE).is_file() and (d / DATA_FILE).is_file()
