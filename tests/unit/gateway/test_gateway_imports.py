"""The gateway process never imports torch or scipy (issue 40): a restarted gateway answers once
its imports are done, and those two were most of them (9 s to the first success after a restart
on a loaded 2-core machine). Run as the gateway runs, in a process of its own: the entry point's
imports, then a model's tokenizer, chat template and index read the way a registry read adds it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from libs.checkpoint.format import DTYPE_ITEMSIZES, SAFETENSORS_DTYPES, dtype_itemsize, torch_dtype

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import asyncio, json, sys
import services.gateway.__main__  # the entry point: its torch guard, then every gateway module
from libs.checkpoint.format import CheckpointIndex
from libs.protocol import messages as m
from services.gateway.service import GatewayService

index = CheckpointIndex.load(sys.argv[1])
info = m.ModelInfo(name="tiny", path=sys.argv[1], arch=index.arch, n_layers=index.n_layers,
                   blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                                       layer_end=b.layer_end) for b in index.blocks],
                   state=m.ModelState.deployed, created_at=0.0)

async def main():
    entry = await GatewayService().add_model(info)
    return entry.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=True,
                                               add_generation_prompt=True)

ids = asyncio.run(main())
ids = ids["input_ids"] if isinstance(ids, dict) else ids
print(json.dumps({"imported": sorted(name for name in ("torch", "scipy") if sys.modules.get(name) is not None),
                  "prompt_tokens": len(ids)}))
"""


def test_the_gateway_loads_and_templates_a_model_without_importing_torch_or_scipy(tiny_checkpoint):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tiny_checkpoint)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["prompt_tokens"] > 1  # the chat template rendered and tokenized
    assert result["imported"] == [], result


def test_index_dtype_sizes_are_torchs():
    for name, size in DTYPE_ITEMSIZES.items():
        assert torch_dtype(name).itemsize == size, name
    assert set(SAFETENSORS_DTYPES.values()) <= set(DTYPE_ITEMSIZES)  # every dtype a conversion writes
    for bad in ("Tensor", "float128", "", 3):
        with pytest.raises(ValueError):
            dtype_itemsize(bad)
