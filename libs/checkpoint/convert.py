"""Convert a Hugging Face safetensors checkpoint (Llama/Qwen2/Mistral-like decoder) into the block format."""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .format import (
    BLOCK_ALIGN,
    DATA_FILE,
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    TENSOR_ALIGN,
    BlockEntry,
    CheckpointIndex,
    TensorEntry,
    align_up,
    torch_dtype,
)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Non-persistent buffers some old checkpoints still carry; the engine recomputes them.
_SKIP_RE = re.compile(r"rotary_emb\.inv_freq$")
# Weight files and their indexes are replaced by blocks.bin; everything else small and textual is copied.
_COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
_SKIP_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", INDEX_FILE)

# Order of tensor groups inside a block: embedding first, then layers in order, final norm, lm_head.
_EMBED, _LAYER, _NORM, _HEAD = range(4)


@dataclass
class _Planned:
    name: str
    source: str  # tensor name in the HF files (differs from name only for a tied lm_head)
    shard: str
    group: int
    layer: int
    order: int
    shape: list[int]
    dtype: str
    nbytes: int


def split_layers(n_layers: int, n_blocks: int) -> list[tuple[int, int]]:
    """Cut [0, n_layers) into n_blocks consecutive ranges whose sizes differ by at most one."""
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or not 1 <= n_blocks <= n_layers:
        raise ValueError(f"n_blocks must be an integer in 1..{n_layers} (the model's layer count), got {n_blocks!r}")
    base, extra = divmod(n_layers, n_blocks)
    ranges, start = [], 0
    for i in range(n_blocks):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def _shard_files(hf_dir: Path) -> list[str]:
    index_path = hf_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    if (hf_dir / "model.safetensors").is_file():
        return ["model.safetensors"]
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors weights in {hf_dir}")
    return shards


def _classify(name: str, n_layers: int) -> tuple[int, int] | None:
    """(group, layer) of a tensor name, None for tensors to drop; ValueError for names we cannot place."""
    if _SKIP_RE.search(name):
        return None
    m = _LAYER_RE.match(name)
    if m:
        layer = int(m.group(1))
        if layer >= n_layers:
            raise ValueError(f"tensor {name} belongs to layer {layer}, but config has {n_layers} layers")
        return _LAYER, layer
    if name.startswith("model.embed_tokens."):
        return _EMBED, -1
    if name.startswith("model.norm."):
        return _NORM, n_layers
    if name.startswith("lm_head."):
        return _HEAD, n_layers
    raise ValueError(f"tensor {name!r} is not part of a Llama/Qwen2/Mistral-style decoder; cannot place it in a block")


def convert_checkpoint(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, n_blocks: int) -> CheckpointIndex:
    """Pack the HF checkpoint in `hf_dir` into `n_blocks` blocks in `out_dir`; returns the saved index.

    Tensors are streamed one at a time from the safetensors files, so memory stays at one tensor.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    n_layers = int(config["num_hidden_layers"])
    ranges = split_layers(n_layers, n_blocks)
    block_of_layer = {layer: b for b, (s, e) in enumerate(ranges) for layer in range(s, e)}

    out_dir.mkdir(parents=True, exist_ok=True)
    # The index marks a complete conversion: drop a stale one before touching blocks.bin.
    (out_dir / INDEX_FILE).unlink(missing_ok=True)

    with ExitStack() as stack:
        handles = {
            shard: stack.enter_context(safe_open(str(hf_dir / shard), framework="pt", device="cpu"))
            for shard in _shard_files(hf_dir)
        }

        # Pass 1: metadata only (shapes and dtypes from the headers), to lay out every block.
        planned: list[_Planned] = []
        where: dict[str, str] = {}
        for shard, h in handles.items():
            for name in h.keys():
                placed = _classify(name, n_layers)
                if placed is None:
                    continue
                if name in where:
                    raise ValueError(f"tensor {name} appears in both {where[name]} and {shard}")
                where[name] = shard
                sl = h.get_slice(name)
                if sl.get_dtype() not in SAFETENSORS_DTYPES:
                    raise ValueError(f"tensor {name} has unsupported dtype {sl.get_dtype()}")
                shape, dtype = list(sl.get_shape()), SAFETENSORS_DTYPES[sl.get_dtype()]
                nbytes = torch_dtype(dtype).itemsize
                for dim in shape:
                    nbytes *= dim
                planned.append(_Planned(name, name, shard, *placed, len(planned), shape, dtype, nbytes))

        if "lm_head.weight" not in where:
            # Tied embeddings: the last block needs its own copy of the head.
            if "model.embed_tokens.weight" not in where:
                raise ValueError(f"{hf_dir} has neither lm_head.weight nor model.embed_tokens.weight")
            emb = next(p for p in planned if p.name == "model.embed_tokens.weight")
            planned.append(_Planned("lm_head.weight", emb.name, emb.shard, _HEAD, n_layers, len(planned), emb.shape, emb.dtype, emb.nbytes))
        for required in ("model.embed_tokens.weight", "model.norm.weight"):
            if required not in where:
                raise ValueError(f"{hf_dir} is missing {required}")
        missing = sorted(set(range(n_layers)) - {p.layer for p in planned if p.group == _LAYER})
        if missing:
            raise ValueError(f"{hf_dir} has no tensors for layers {missing}")

        def block_id(p: _Planned) -> int:
            if p.group == _EMBED:
                return 0
            if p.group == _LAYER:
                return block_of_layer[p.layer]
            return n_blocks - 1

        per_block: list[list[_Planned]] = [[] for _ in range(n_blocks)]
        for p in sorted(planned, key=lambda p: (p.group, p.layer, p.order)):
            per_block[block_id(p)].append(p)

        # Pass 2: write blocks sequentially, checksumming as we go (no read-back).
        blocks: list[BlockEntry] = []
        tensors: list[TensorEntry] = []
        data_path = out_dir / DATA_FILE
        tmp_path = data_path.with_name(DATA_FILE + ".tmp")
        with open(tmp_path, "wb") as f:
            pos = 0
            for b, members in enumerate(per_block):
                block_offset = align_up(pos, BLOCK_ALIGN)
                f.write(bytes(block_offset - pos))
                crc, in_block = 0, 0
                for p in members:
                    start = align_up(in_block, TENSOR_ALIGN)
                    pad = bytes(start - in_block)
                    f.write(pad)
                    crc = zlib.crc32(pad, crc)
                    t = handles[p.shard].get_tensor(p.source)
                    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                    assert data.nbytes == p.nbytes, p.name
                    f.write(data)
                    crc = zlib.crc32(data, crc)
                    del t, data
                    tensors.append(TensorEntry(p.name, b, start, p.nbytes, p.shape, p.dtype))
                    in_block = start + p.nbytes
                # Round the region to TENSOR_ALIGN so a block buffer's size is always a multiple of it.
                nbytes = align_up(in_block, TENSOR_ALIGN)
                pad = bytes(nbytes - in_block)
                f.write(pad)
                crc = zlib.crc32(pad, crc)
                layer_start, layer_end = ranges[b]
                blocks.append(
                    BlockEntry(
                        id=b,
                        offset=block_offset,
                        nbytes=nbytes,
                        checksum=f"{crc:08x}",
                        layer_start=layer_start,
                        layer_end=layer_end,
                        has_embedding=any(p.group == _EMBED for p in members),
                        has_head=b == n_blocks - 1,
                    )
                )
                pos = block_offset + nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, data_path)

    _copy_side_files(hf_dir, out_dir)
    arch = (config.get("architectures") or [None])[0] or config["model_type"]
    index = CheckpointIndex(
        arch=arch,
        model_type=config["model_type"],
        n_layers=n_layers,
        config=config,
        blocks=blocks,
        tensors=tensors,
    )
    index.save(out_dir)
    return index


def _copy_side_files(hf_dir: Path, out_dir: Path) -> None:
    """Config, generation config and tokenizer files, so out_dir alone can be served."""
    for src in hf_dir.iterdir():
        if not src.is_file() or src.name.startswith(".") or src.name in _SKIP_FILES:
            continue
        if not src.name.endswith(_COPY_SUFFIXES):
            continue
        dst = out_dir / src.name
        if dst.exists() and os.path.samefile(src, dst):
            continue
        shutil.copy2(src, dst)
