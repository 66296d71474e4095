"""A live pair's split prefill (libs/engine/livepair.py, BlitzScale §5.2): the loading target runs
blocks [0, k) of a prefill batch and hands back the hidden state and those layers' KV; the source
runs [k, n) over that KV and decodes alone. Same greedy tokens as the source alone, for the Llama
and Qwen2 demo architectures, whatever k each batch gets."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest_models import N_BLOCKS, arch, block_dir, drain_tokens, hf_dir, load_all  # noqa: F401  (fixtures)

from libs.engine import Engine, LayerRange, SamplingSpec
from libs.engine.livepair import PrefillFront
from libs.planning.livepair import PrefillSplitter

PROMPTS = [[1, 17, 200, 45, 301, 99, 7, 450, 12, 64], [5, 6], [300, 2, 9, 44, 81, 7, 120], list(range(3, 30)),
           [8, 9, 10, 11]]
GREEDY = SamplingSpec(temperature=0, max_tokens=8)


def staggered(engine: Engine) -> dict[str, list[int]]:
    """Requests arriving over several steps, so that successive prefill batches differ."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
        if i % 2:
            for o in engine.step():
                out.setdefault(o.request_id, []).append(o.token_id)
    return drain_tokens(engine, out)


@pytest.fixture(scope="module")
def alone(block_dir) -> dict[str, list[int]]:
    return staggered(Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64, prefill_chunk=4,
                                            eos_token_ids=()))


class _Counted(PrefillFront):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple[tuple[str, ...], int]] = []

    def forward(self, request_ids, inputs, q_len, blocks):
        self.calls.append((tuple(request_ids), blocks))
        return super().forward(request_ids, inputs, q_len, blocks)


def target_front(block_dir, blocks=None) -> _Counted:
    index, own = load_all(block_dir)  # the target's own copy of the weights
    model = LayerRange(index, own if blocks is None else blocks, device="cpu")
    return _Counted(model, slots=8, max_seq_len=64)


def source(block_dir) -> Engine:
    return Engine.from_checkpoint(block_dir, max_batch_size=8, max_seq_len=64, prefill_chunk=4, eos_token_ids=())


@pytest.mark.parametrize("splits", [(1,), (2,), (1, 2, 0, 2)])
def test_a_split_prefill_gives_the_tokens_of_the_source_alone(block_dir, alone, splits):
    front = target_front(block_dir)
    engine = source(block_dir)
    chosen = itertools.cycle(splits)
    decided: list[int] = []

    def splitter(keys):
        decided.append(next(chosen))
        return decided[-1]

    engine.pair_with(front, splitter)
    assert staggered(engine) == alone
    # Several batches, each split as told (k differs between requests of one run), every chunk of
    # a prompt split alike (prefill_chunk 4 cuts the long prompts), and nothing left on the target.
    assert len(decided) >= 3 and {k for k in decided if k} == {k for k in splits if k}
    assert {k for _, k in front.calls} == {k for k in splits if k}
    split_of = {}
    for ids, k in front.calls:
        for rid in ids:
            assert split_of.setdefault(rid, k) == k, f"{rid}'s chunks were split at different blocks"
    assert max(sum(rid in ids for ids, _ in front.calls) for rid in split_of) >= 2  # a prompt in chunks
    assert front.kv.free_slots == front.kv.slots
    assert engine.paired and not engine._split_of


def test_decode_never_goes_to_the_target(block_dir, alone):
    front = target_front(block_dir)
    engine = source(block_dir)
    engine.pair_with(front, lambda keys: 2)
    assert staggered(engine) == alone
    prefill_tokens = sum(len(p) for p in PROMPTS)
    # Every call is a prefill chunk: at most ceil(len / chunk) per prompt, never one per generated token.
    assert len(front.calls) <= sum(-(-len(p) // 4) for p in PROMPTS) < prefill_tokens


class _Arriving:
    """Blocks that land one by one (a BlockSource): the front may run only what it holds."""

    def __init__(self, blocks):
        self.blocks, self.landed = blocks, set()

    def ready(self, b):
        return b in self.landed

    def wait(self, b, timeout=None):
        assert b in self.landed, f"the front waited for block {b}, which the splitter knew was not held"
        return self.blocks[b]


def test_the_zigzag_splitter_grows_the_split_as_blocks_land_and_the_pair_dissolves_at_the_last(block_dir, alone):
    index, own = load_all(block_dir)
    arriving = _Arriving(own)
    front = _Counted(LayerRange(index, arriving, device="cpu"), slots=8, max_seq_len=64)
    splitter = PrefillSplitter(N_BLOCKS, cap=N_BLOCKS - 1)
    engine = source(block_dir)
    engine.pair_with(front, splitter)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
        if i < N_BLOCKS:  # a block lands between batches
            arriving.landed.add(i)
            splitter.held(len(arriving.landed))
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
        if len(arriving.landed) == N_BLOCKS:
            engine.unpair()  # every block held: the pair dissolves, the target becomes a normal instance
    assert not engine.paired
    assert drain_tokens(engine, out) == alone
    assert splitter.splits[:2] == [1, 2] and splitter.splits == sorted(splitter.splits)
    assert front.kv.free_slots == front.kv.slots  # the dissolution left nothing on the target


def test_a_pair_ended_mid_prefill_finishes_it_on_the_source_alone(block_dir, alone):
    front = target_front(block_dir)
    engine = source(block_dir)
    engine.pair_with(front, lambda keys: 1)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    for o in engine.step():  # the first chunk of every prompt: split
        out.setdefault(o.request_id, []).append(o.token_id)
    assert {c[1] for c in front.calls} == {1}
    mid = [k for k, blocks in engine._split_of.items() if blocks]
    assert mid, "a prompt longer than a chunk is mid-prefill"
    engine.unpair()  # the target is gone: its front KV of the first chunks is already on the source
    calls = len(front.calls)
    assert drain_tokens(engine, out) == alone
    assert len(front.calls) == calls and front.kv.free_slots == front.kv.slots


def test_a_cancelled_split_request_frees_its_front_slot(block_dir):
    front = target_front(block_dir)
    engine = source(block_dir)
    engine.pair_with(front, lambda keys: 1)
    engine.add_request("long", list(range(3, 30)), GREEDY)
    engine.step()
    assert front.kv.free_slots == front.kv.slots - 1
    assert engine.cancel("long")
    assert front.kv.free_slots == front.kv.slots and not engine._split_of


def test_a_front_refuses_a_split_outside_what_it_may_run(block_dir):
    front = target_front(block_dir)
    front.open("x")
    with pytest.raises(ValueError):
        front.forward(["x"], torch.tensor([[1, 2]]), 2, N_BLOCKS)  # the source must keep a block
    with pytest.raises(ValueError):
        front.forward(["x"], torch.tensor([[1, 2]]), 2, 0)


class _Failing(_Counted):
    """A target that dies after `ok` passes (its worker gone, its link cut)."""

    def __init__(self, *a, ok: int, **kw):
        super().__init__(*a, **kw)
        self.ok = ok

    def forward(self, request_ids, inputs, q_len, blocks):
        if len(self.calls) >= self.ok:
            raise ConnectionError("stage front on w-target: connection reset")
        return super().forward(request_ids, inputs, q_len, blocks)


def test_a_target_that_fails_mid_prefill_leaves_the_source_serving_alone_with_the_same_tokens(block_dir, alone):
    index, own = load_all(block_dir)
    front = _Failing(LayerRange(index, own, device="cpu"), slots=8, max_seq_len=64, ok=2)
    engine = source(block_dir)
    lost: list[str] = []
    engine.pair_with(front, lambda keys: 1, on_lost=lost.append)
    assert staggered(engine) == alone
    assert len(front.calls) == 2 and not engine.paired and "connection reset" in engine.pair_error
    assert lost == [engine.pair_error]  # said once, for the worker's lifecycle (PairLost)


def test_a_remote_front_over_the_data_plane_gives_the_same_tokens(block_dir, alone):
    from libs.engine import RemoteStage, StageServer
    from libs.engine.livepair import RemoteFront
    from libs.transfer.tcp.transport import TcpTransport

    front = target_front(block_dir)
    with TcpTransport("w-source") as src_t, TcpTransport("w-target") as tgt_t:
        server = StageServer(tgt_t, {"w-source": src_t.address})
        try:
            server.add("i-target/front", front)
            remote = RemoteFront(RemoteStage(src_t, "w-target", tgt_t.address, "i-target/front", slots=8),
                                 front.model.index)
            assert remote.held() == N_BLOCKS - 1  # every block there, the source keeps one
            engine = source(block_dir)
            engine.pair_with(remote, lambda keys: 2)
            assert staggered(engine) == alone
            assert front.passes >= len(PROMPTS) and front.kv.free_slots == front.kv.slots
        finally:
            server.close()


class _Deferred(_Counted):
    """A front that answers later (as a remote one does): `submit` sends, `result()` computes. It
    notes the source's KV tokens at both ends, to see what the source ran in between."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.source_kv: list[tuple[int, int]] = []  # (at submit, at result) per call
        self.engine: Engine | None = None

    def _source_tokens(self) -> int:
        return int(sum(self.engine.stages[0].kv.lengths))

    def submit(self, request_ids, inputs, q_len, blocks):
        at_submit = self._source_tokens()
        front = self

        class _Call:
            def result(self):
                out = front.forward(request_ids, inputs, q_len, blocks)
                front.source_kv.append((at_submit, front._source_tokens()))
                return out
        return _Call()


def test_the_source_decodes_while_the_target_runs_a_prefills_front(block_dir, alone):
    """The step's decode passes run between sending a prefill's front and taking its answer, so
    the source computes while the target does (it does not wait idle for the blocks it lent)."""
    index, own = load_all(block_dir)
    front = _Deferred(LayerRange(index, own, device="cpu"), slots=8, max_seq_len=64)
    engine = source(block_dir)
    front.engine = engine
    engine.pair_with(front, lambda keys: 2)
    assert staggered(engine) == alone
    assert front.source_kv and len(front.source_kv) == len(front.calls)
    # Requests were decoding when later prompts' fronts went out: their tokens landed in between.
    assert any(after > before for before, after in front.source_kv)
