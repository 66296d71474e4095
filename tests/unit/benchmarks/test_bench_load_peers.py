"""`bench load`'s loader peers (runai-model-streamer, fastsafetensors: the bench-peers extra).

Behaviour, not timing: each installed peer reads the tiny checkpoint's safetensors file into the
same tensors safetensors reads, at the library default and at an explicit thread count, and the
model built from what it read gives the same logits; a peer that is not installed is reported with
its reason instead of failing the benchmark."""

import os

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.bench_load import (
    PEER_LOADERS, PEERS, _first_logits_from_safetensors, _peers_section, _Trials, measure_peer, peer_status,
)
from libs.checkpoint import CheckpointIndex
from libs.checkpoint.format import torch_dtype


@pytest.fixture(scope="module")
def tiny_safetensors(tiny_checkpoint):
    """The tiny model's HF folder, its weight files, dtype, tensors and first logits (safetensors')."""
    hf = tiny_checkpoint.parent / "hf"
    weights = sorted(hf.glob("*.safetensors"))
    index = CheckpointIndex.load(tiny_checkpoint)
    dtype = torch_dtype(next(t.dtype for t in index.tensors if ".layers." in t.name))
    tensors = {k: v for w in weights for k, v in load_file(w).items()}
    return hf, weights, dtype, tensors, _first_logits_from_safetensors(hf, weights, dtype)


@pytest.mark.parametrize("name", list(PEERS))
def test_peer_reads_the_same_tensors_and_serves_the_same_logits(tiny_safetensors, name):
    reason = peer_status(name)
    if reason is not None:
        pytest.skip(reason)
    hf, weights, dtype, expected, reference = tiny_safetensors

    state = PEER_LOADERS[name](weights, None)  # the library's defaults
    assert set(state) == set(expected)
    for key, tensor in expected.items():
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key

    env_before = os.environ.get("RUNAI_STREAMER_CONCURRENCY")
    figures, logits = measure_peer(name, 2, hf, weights, dtype)  # an explicit thread count
    assert os.environ.get("RUNAI_STREAMER_CONCURRENCY") == env_before  # the setting does not leak
    # The tensors are bit-equal (above); a buffer's alignment may still pick another SIMD kernel, so
    # the logits agree to float rounding, and on the token.
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert int(logits.argmax()) == int(reference.argmax())
    assert figures["cold_gbps"] > 0 and figures["warm_gbps"] > 0 and figures["ready_s"] > 0
    assert figures["peak_rss_mb"] >= 0  # Linux: the high-water mark could be reset and read


def test_a_peer_that_is_not_installed_is_skipped_with_its_reason(monkeypatch):
    monkeypatch.setitem(PEERS, "absent_peer", ("layercast_no_such_module", "absent-peer", 4))
    reason = peer_status("absent_peer")
    assert reason is not None and "not installed" in reason and "bench-peers" in reason
    skipped = {name: peer_status(name) or "not run" for name in PEERS}
    section = _peers_section(_Trials(), skipped, [], {}, torch.zeros(1))
    assert section["absent_peer"] == {"skipped": reason}
