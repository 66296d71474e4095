"""A live pair's split prefill on the target device (BlitzScale §5.2; libs/engine/livepair.py): the
loading target's front runs blocks [0, k) of each prefill batch on the device and hands back the
hidden state and those layers' KV, the source writes that KV into its device cache, runs [k, n)
and decodes alone. Greedy tokens equal the source alone on the same device (Llama, Qwen2), for k
fixed and k varying between batches; the front's KV slots are all free at the end."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from conftest_models import load_all

from libs.engine import Engine, LayerRange
from libs.engine.livepair import PrefillFront

sys.path.append(str(Path(__file__).parents[1] / "unit" / "engine"))
from test_engine_livepair import PROMPTS, staggered  # noqa: E402  (the CPU test's prompts and arrival order)

pytestmark = pytest.mark.gpu


def _source(block_dir, device) -> Engine:
    return Engine.from_checkpoint(block_dir, device=device, max_batch_size=8, max_seq_len=64, prefill_chunk=4,
                                  eos_token_ids=())


@pytest.mark.parametrize("splits", [(1,), (1, 2, 0, 2)], ids=["k=1", "k-varies"])
def test_a_split_prefill_on_the_device_gives_the_tokens_of_the_source_alone(block_dir, device, splits):
    alone = staggered(_source(block_dir, device))
    index, own = load_all(block_dir)  # the target's own copy of the weights
    front = PrefillFront(LayerRange(index, own, device=device), slots=8, max_seq_len=64)
    assert all(t.device.type == device.type for t in front.kv.keys)
    engine = _source(block_dir, device)
    chosen = itertools.cycle(splits)
    decided: list[int] = []

    def splitter(keys):
        decided.append(next(chosen))
        return decided[-1]

    engine.pair_with(front, splitter)
    assert staggered(engine) == alone
    assert {k for k in decided if k} == {k for k in splits if k}
    assert front.passes >= len(PROMPTS) and front.kv.free_slots == front.kv.slots  # nothing left on the target
