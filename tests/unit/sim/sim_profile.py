"""The simulator tests' small GPU-like profile, a fixture imported by each test module (not a
conftest.py: a second `conftest` module shadows tests/conftest.py for `from conftest import`)."""

import pytest

from libs.sim.profile import profile_from_dict

# A small GPU-like profile: 1 GB in 32 blocks, 100 Gbit/s links, 2 GB/s disk, 20 GB/s to the device.
PROFILE = {
    "name": "test",
    "values": {"link_gbps": 100, "model_bytes": 1_000_000_000, "n_blocks": 32, "disk_gbytes_per_s": 2,
               "h2d_gbytes_per_s": 20, "max_batch": 8, "nats_hop_s": 0.001, "registry_read_s": 0.005,
               "step_overhead_s": 0.003, "engine_build_s": 0.0},
    "compute": {"prefill_lengths": [1, 512, 2048], "prefill_s": [0.01, 0.04, 0.15], "batches": [1, 8],
                "lengths": [128, 2048], "decode_s": [[0.02, 0.025], [0.03, 0.045]]},
}


@pytest.fixture
def profile():
    return profile_from_dict(PROFILE)
