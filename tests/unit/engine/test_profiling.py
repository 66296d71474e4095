"""LLM-Mesh §5.2: a profile measured with the serving engine on a real (tiny) checkpoint."""

import json

from typer.testing import CliRunner

from libs.engine import Engine
from libs.engine.profiling import measure_profile
from libs.planning.mesh import Profile
from services.cli.app import app


def test_a_measured_profile_samples_powers_of_two_and_times_every_point(tiny_checkpoint):
    seen = []

    def make(batch, seq):
        seen.append((batch, seq))
        return Engine.from_checkpoint(tiny_checkpoint, max_batch_size=batch, max_seq_len=seq)

    prof = measure_profile(make, max_len=64, max_batch=4, repeats=2)
    assert prof.prefill_lengths == prof.lengths == (1, 2, 4, 8, 16, 32, 64) and prof.batches == (1, 2, 4)
    assert seen == [(4, 68)]  # one engine, long enough for the longest prompt and the timed steps
    assert all(t > 0 for t in prof.prefill_s) and all(t > 0 for row in prof.decode_s for t in row)


def test_layercast_model_profile_prints_a_loadable_profile(tiny_checkpoint, tmp_path):
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["model", "profile", str(tiny_checkpoint), "--max-len", "8",
                                      "--max-batch", "2", "--repeats", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    prof = Profile(**{k: tuple(tuple(v) if isinstance(v, list) else v for v in vs) for k, vs in data.items()})
    assert prof.batches == (1, 2) and prof.decode_time(2, 4) > 0
