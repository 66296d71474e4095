"""2D pipelining across steps (λScale Fig. 6a; libs/planning/microbatches.py drives it): a pipeline
of s stages keeps up to s micro-batches in flight continuously, a micro-batch's next decode step
entering stage 0 as soon as its token is sampled, while the next stage still computes another
micro-batch's step. Its second stage runs behind a StageServer on its own thread (over TCP, as
on another worker); every stage is slowed by the same delay per layer and row (compute-bound
stages, as a worker's CPU quota makes them), so a stage costs what its share of the layers does.
Same greedy tokens as one stage holding every layer."""

from __future__ import annotations

import time

import pytest
import torch

from libs.checkpoint import CheckpointIndex, convert_checkpoint, create_demo_checkpoint, load_block
from libs.engine import Engine, LayerRange, LocalStage, RemoteStage, SamplingSpec, StageServer
from libs.transfer.tcp.transport import TcpTransport

pytestmark = pytest.mark.slow  # two slowed runs of the model: a few seconds

ROWS, NEW_TOKENS = 8, 10
PROMPT = [1, 17, 200, 45, 301, 99]
DELAY_S = 0.012  # per layer and row of a forward pass: far above the tiny model's compute


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = create_demo_checkpoint(tmp_path_factory.mktemp("hf"), preset="tiny", arch="llama", seed=0)
    out = tmp_path_factory.mktemp("blocks")
    convert_checkpoint(hf, out, 4)  # 4 layers: one per block
    index = CheckpointIndex.load(out)
    return index, {b: load_block(out, index, b) for b in range(index.n_blocks)}


class _Slowed:
    """A local stage that takes DELAY_S per layer and row of each pass (the sleep lets the other
    stage's thread run) and logs when each pass starts and ends, with its rows' positions."""

    def __init__(self, name: str, stage: LocalStage, log: list):
        self.name, self.stage, self.log, self.slots = name, stage, log, stage.slots
        self.layers = stage.model.layer_end - stage.model.layer_start

    def open(self, request_id):
        self.stage.open(request_id)

    def close(self, request_id):
        self.stage.close(request_id)

    def fork(self, src, dst, length):
        self.stage.fork(src, dst, length)

    def forward(self, request_ids, inputs, q_len, logits_to_keep=0):
        at = {r: self.stage.length(r) for r in request_ids}
        self.log.append(("start", self.name, at))  # list.append: atomic, so the log is in event order
        time.sleep(DELAY_S * self.layers * len(request_ids))
        out = self.stage.forward(request_ids, inputs, q_len, logits_to_keep)
        self.log.append(("end", self.name, at))
        return out


def _run(engine: Engine) -> tuple[dict[str, list[int]], float]:
    """ROWS requests at once; their tokens, and the decode throughput (tokens/s once every request
    has its first token). One torch thread: the stages' threads, not torch's, run at once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _steps(engine)
    finally:
        torch.set_num_threads(threads)


def _steps(engine: Engine) -> tuple[dict[str, list[int]], float]:
    for i in range(ROWS):
        engine.add_request(f"r{i}", PROMPT, SamplingSpec(temperature=0, max_tokens=NEW_TOKENS))
    out: dict[str, list[int]] = {}
    started = None
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o.token_id)
        if started is None and len(out) == ROWS:
            started = time.perf_counter()
    return out, ROWS * (NEW_TOKENS - 1) / (time.perf_counter() - started)


@pytest.fixture(scope="module")
def one_stage(model):
    index, blocks = model
    log: list = []
    engine = Engine(index, stages=[_Slowed("all", LocalStage(LayerRange(index, blocks, 0, 4), ROWS, 64), log)],
                    max_batch_size=ROWS, max_seq_len=64, eos_token_ids=())
    return _run(engine)


@pytest.fixture(scope="module")
def two_stages(model):
    index, blocks = model
    log: list = []
    head, host = TcpTransport("head"), TcpTransport("host")
    server = StageServer(host, {"head": head.address})
    try:
        server.add("s1", _Slowed("s1", LocalStage(LayerRange(index, blocks, 2, 4), ROWS, 64), log))
        stages = [_Slowed("s0", LocalStage(LayerRange(index, blocks, 0, 2), ROWS, 64), log),
                  RemoteStage(head, "host", host.address, "s1", slots=ROWS)]
        engine = Engine(index, stages=stages, max_batch_size=ROWS, max_seq_len=64, eos_token_ids=())
        assert engine.micro_batches == 2
        out, throughput = _run(engine)
        return out, throughput, log
    finally:
        server.close()
        head.close()
        host.close()


def test_two_stages_give_the_tokens_of_one(one_stage, two_stages):
    assert two_stages[0] == one_stage[0]
    assert all(len(t) == NEW_TOKENS for t in one_stage[0].values())


def test_a_two_stage_pipeline_decodes_above_one_and_a_half_times_one_stage(one_stage, two_stages):
    """Each stage holds half the layers: kept busy with a micro-batch each, the pipeline decodes
    twice as fast as one stage holding every layer (a barrier every step, filling and draining
    the stages, gives 4/3 at most)."""
    ratio = two_stages[1] / one_stage[1]
    assert ratio > 1.5, f"2-stage decode throughput only {ratio:.2f}x one stage's"


def test_a_micro_batch_enters_stage_0_for_its_next_step_while_stage_1_computes_another(two_stages):
    """From the stage log: during most decode steps, stage 0 computes a micro-batch's step t + 1
    while stage 1 computes another micro-batch's step t (rows disjoint): no step-wide barrier. A
    pipeline that drains every step never does (step t + 1 waits for all of step t)."""
    log = two_stages[2]
    passes: dict[str, list] = {"s0": [], "s1": []}  # per stage: [first event, last event, positions]
    for i, (kind, stage, at) in enumerate(log):
        if kind == "start":
            passes[stage].append([i, None, at])
        else:
            passes[stage][-1][1] = i
    across = sum(1 for a0, b0, at0 in passes["s0"]
                 if any(a0 < b1 and a1 < b0 and not set(at0) & set(at1) and min(at0.values()) > max(at1.values())
                        for a1, b1, at1 in passes["s1"]))
    # NEW_TOKENS - 1 decode steps for each of the 2 micro-batches: most overlap a step of the other.
    assert across >= NEW_TOKENS // 2, f"only {across} passes entered stage 0 across a step of stage 1"
    # A stage computes one pass at a time, and a row's steps enter stage 0 in order, one by one.
    for stage in ("s0", "s1"):
        kinds = [kind for kind, st, _ in log if st == stage]
        assert kinds == ["start", "end"] * (len(kinds) // 2)
    seen: dict[str, int] = {}
    for kind, stage, at in log:
        if kind == "start" and stage == "s0":
            for r, pos in at.items():
                assert pos > seen.get(r, -1)
                seen[r] = pos
