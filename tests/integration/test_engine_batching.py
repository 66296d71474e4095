"""The serving engine: continuous batching on a slot KV cache, pipeline stages, KV recompute.

Same greedy tokens however the model is split: local == 2-stage == 4-stage == hand-over at an
arbitrary token (KV recomputed, also in another process) == Hugging Face generate(), for the
Llama and the Qwen2 demo architectures, with requests running concurrently.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest_models import arch, drain_tokens, hf_dir, reference_model  # noqa: F401  (fixtures)

from libs.checkpoint import CheckpointIndex, convert_checkpoint, load_block
from libs.engine import AdmissionError, Engine, LayerRange, LocalStage, RemoteStage, SamplingSpec, StageServer
from libs.engine.stages import pack, unpack
from libs.transfer.tcp.transport import TcpTransport

PROMPTS = [[1, 17, 200, 45, 301, 99, 7, 450, 12, 64], [5, 6], [300, 2, 9, 44, 81, 7, 120],
           list(range(3, 40))]
MAX_NEW = 10


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory, hf_dir) -> Path:
    out = tmp_path_factory.mktemp("four-blocks")
    convert_checkpoint(hf_dir, out, 4)  # the tiny preset has 4 layers: one per block
    return out


@pytest.fixture(scope="module")
def expected(hf_dir) -> list[list[int]]:
    model = reference_model(hf_dir)
    outs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
            outs.append(ids[0, len(p):].tolist())
    return outs


def greedy(n: int = MAX_NEW) -> SamplingSpec:
    return SamplingSpec(temperature=0, max_tokens=n)


def run_all(engine: Engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):  # concurrent: one batched decode per step
        engine.add_request(f"r{i}", p, greedy())
    out = drain_tokens(engine)
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("splits", [(), (2,), (1, 2, 3)], ids=["local", "2-stage", "4-stage"])
def test_local_and_pipelined_engines_equal_generate(four_blocks, expected, splits):
    engine = Engine.from_checkpoint(four_blocks, splits=splits, max_batch_size=8, max_seq_len=128, eos_token_ids=())
    assert len(engine.stages) == len(splits) + 1
    assert run_all(engine) == expected


@pytest.mark.parametrize("at", [1, 4, 9])
def test_hand_over_by_kv_recompute_continues_exactly(four_blocks, expected, at):
    """A request moved after `at` tokens: the new engine recomputes its KV from the tokens and goes on."""
    engine = Engine.from_checkpoint(four_blocks, splits=(2,), max_batch_size=8, max_seq_len=128, eos_token_ids=())
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"m{i}", p, greedy(), generated_ids=expected[i][:at])
    out = drain_tokens(engine)
    assert [expected[i][:at] + out[f"m{i}"] for i in range(len(PROMPTS))] == expected


def test_two_stage_catch_up_then_release(four_blocks, expected):
    """ServerlessLLM §5.2: recompute from a snapshot, catch up with what the source made meanwhile, switch."""
    engine = Engine.from_checkpoint(four_blocks, max_batch_size=4, max_seq_len=128, eos_token_ids=())
    want = expected[0]
    engine.add_request("m", PROMPTS[0], greedy(), generated_ids=want[:3], hold=True)
    assert drain_tokens(engine) == {}  # prefilled, held: no tokens while the source still decodes
    engine.catch_up("m", want[3:6])
    assert drain_tokens(engine) == {}
    engine.release("m")
    assert want[:6] + drain_tokens(engine)["m"] == want


def test_chunked_prefill_mixed_with_decodes_gives_the_same_tokens(four_blocks, expected):
    engine = Engine.from_checkpoint(four_blocks, max_batch_size=8, max_seq_len=128, eos_token_ids=(),
                                    prefill_chunk=4, token_budget=10)
    engine.add_request("r0", PROMPTS[0], greedy())
    engine.step()  # r0 prefills in chunks of 4 and starts decoding; r3 (37 tokens) joins mid-way
    engine.add_request("r3", PROMPTS[3], greedy())
    out = drain_tokens(engine)
    assert out["r0"] == expected[0] and out["r3"] == expected[3]


def test_flood_beyond_the_kv_budget_is_queued_or_refused_and_nothing_is_lost(four_blocks, expected):
    index = CheckpointIndex.load(four_blocks)
    probe = Engine.from_checkpoint(four_blocks, max_batch_size=1, max_seq_len=64)
    per_slot = probe.stages[0].kv.nbytes
    engine = Engine.from_checkpoint(four_blocks, max_batch_size=16, max_seq_len=64, kv_cache_bytes=3 * per_slot,
                                    max_queue=5, eos_token_ids=())
    assert engine.max_batch_size == 3 and engine.stages[0].kv.nbytes <= 3 * per_slot
    accepted, refused = [], []
    for i in range(12):
        try:
            engine.add_request(f"f{i}", PROMPTS[i % 4], greedy())
            accepted.append(i)
        except AdmissionError as e:
            assert "full" in str(e)
            refused.append(i)
    assert len(accepted) == 8 and len(refused) == 4  # 3 running + 5 queued
    out = drain_tokens(engine)
    assert {f"f{i}": expected[i % 4] for i in accepted} == out
    assert index.n_blocks == 4


def test_activations_serialise_exactly():
    h = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    header, t = unpack(pack({"op": "forward", "q_len": 3}, h))
    assert header["op"] == "forward" and t.dtype == torch.bfloat16 and torch.equal(t, h)
    with pytest.raises(ValueError):
        unpack(b"\x00\x00\x00\x05[1,2]")


STAGE_HOST = textwrap.dedent("""
    import sys, time
    from libs.checkpoint import CheckpointIndex, load_block
    from libs.engine import LayerRange, LocalStage, StageServer
    from libs.transfer.tcp.transport import TcpTransport
    ckpt, start, end, caller, caller_address = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    node = sys.argv[6] if len(sys.argv) > 6 else "stage-host"
    index = CheckpointIndex.load(ckpt)
    blocks = {b: load_block(ckpt, index, b) for b in range(start, end)}  # only what this worker holds
    t = TcpTransport(node)
    server = StageServer(t, {caller: caller_address})
    server.add("stage", LocalStage(LayerRange(index, blocks, start, end), 8, 128))
    print(t.address, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.close()
    t.close()
""")


def stop_stage_host(host: subprocess.Popen) -> None:
    """Close its stdin (it then closes its server and exits); a host that has not exited within
    60 s (interpreter teardown on a loaded machine) is killed: its exit is not under test."""
    host.stdin.close()
    try:
        host.wait(60)
    except subprocess.TimeoutExpired:
        host.kill()
        host.wait()


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 2, 3, 4)], ids=["2-stage", "4-stage"])
def test_pipeline_across_processes_over_the_data_plane(four_blocks, expected, bounds):
    """Every stage after the first runs in its own process; activations go over the transport's
    message channel, and the engine keeps a micro-batch per stage in flight (2D pipelining).
    One remote stage, and three in a row (remote to remote); a 3-stage split adds nothing across
    processes that these miss (test_local_and_pipelined_engines_equal_generate splits locally)."""
    index = CheckpointIndex.load(four_blocks)
    blocks = {b: load_block(four_blocks, index, b) for b in range(bounds[1])}
    ranges = list(zip(bounds[1:], bounds[2:]))
    with TcpTransport("head") as t:
        hosts = [subprocess.Popen([sys.executable, "-c", STAGE_HOST, str(four_blocks), str(a), str(b), "head",
                                   t.address, f"stage-host-{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                 for i, (a, b) in enumerate(ranges)]
        try:
            addresses = [h.stdout.readline().decode().strip() for h in hosts]
            stages = [LocalStage(LayerRange(index, blocks, 0, bounds[1]), 8, 128),
                      *(RemoteStage(t, f"stage-host-{i}", address, "stage", slots=8)
                        for i, address in enumerate(addresses))]
            engine = Engine(index, stages=stages, max_batch_size=8, max_seq_len=128, eos_token_ids=())
            assert engine.micro_batches == len(bounds) - 1
            assert run_all(engine) == expected
        finally:
            for host in hosts:
                stop_stage_host(host)


class _Clocked:
    """A stage that takes `seconds` per forward pass and counts passes running at once, everywhere."""

    running = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, stage: LocalStage, seconds: float):
        self.stage, self.seconds, self.slots = stage, seconds, stage.slots

    def open(self, request_id):
        self.stage.open(request_id)

    def close(self, request_id):
        self.stage.close(request_id)

    def forward(self, request_ids, inputs, q_len, logits_to_keep=0):
        with _Clocked.lock:
            _Clocked.running += 1
            _Clocked.most = max(_Clocked.most, _Clocked.running)
        try:
            time.sleep(self.seconds)
            return self.stage.forward(request_ids, inputs, q_len, logits_to_keep)
        finally:
            with _Clocked.lock:
                _Clocked.running -= 1


def test_2d_pipelining_keeps_every_stage_busy_with_its_own_micro_batch(four_blocks, expected):
    """λScale Fig. 6a: with 4 stages and 4 micro-batches, stages compute different micro-batches
    at the same time (one stage at a time would never overlap), and tokens stay exact."""
    index = CheckpointIndex.load(four_blocks)
    blocks = {b: load_block(four_blocks, index, b) for b in range(4)}
    transports = [TcpTransport(f"n{i}") for i in range(4)]
    servers = [StageServer(transports[i], {"n0": transports[0].address}) for i in range(1, 4)]
    try:
        for i, server in enumerate(servers, start=1):
            server.add("stage", _Clocked(LocalStage(LayerRange(index, blocks, i, i + 1), 8, 128), 0.02))
        stages = [_Clocked(LocalStage(LayerRange(index, blocks, 0, 1), 8, 128), 0.02),
                  *(RemoteStage(transports[0], f"n{i}", transports[i].address, "stage", slots=8) for i in range(1, 4))]
        engine = Engine(index, stages=stages, max_batch_size=8, max_seq_len=128, eos_token_ids=())
        _Clocked.most = 0
        assert run_all(engine) == expected
        assert _Clocked.most >= 2  # one stage at a time: never more than 1
    finally:
        for server in servers:
            server.close()
        for t in transports:
            t.close()


def test_a_burst_of_prompts_is_prefilled_in_micro_batches_the_stages_compute_at_once(four_blocks, expected):
    """A burst's prefill goes as one micro-batch per stage, so the second
    stage works on the first micro-batch while the first stage takes the next (one pass for all
    rows would leave one stage idle while the other computes). Prefilled tokens stay exact."""
    index = CheckpointIndex.load(four_blocks)
    blocks = {b: load_block(four_blocks, index, b) for b in range(4)}
    transports = [TcpTransport(f"p{i}") for i in range(2)]
    server = StageServer(transports[1], {"p0": transports[0].address})
    try:
        server.add("stage", _Clocked(LocalStage(LayerRange(index, blocks, 2, 4), 8, 128), 0.05))
        stages = [_Clocked(LocalStage(LayerRange(index, blocks, 0, 2), 8, 128), 0.05),
                  RemoteStage(transports[0], "p1", transports[1].address, "stage", slots=8)]
        engine = Engine(index, stages=stages, max_batch_size=8, max_seq_len=128, eos_token_ids=())
        prompt = PROMPTS[0]
        for i in range(4):
            engine.add_request(f"b{i}", prompt, greedy())
        _Clocked.most = 0
        first = engine.step()  # the prefill of the first micro-batch (a step returns each as it lands)
        while len(first) < 4:
            first += engine.step()
        assert sorted(o.request_id for o in first) == [f"b{i}" for i in range(4)]
        assert all(o.token_id == expected[0][0] for o in first)
        assert _Clocked.most >= 2
    finally:
        server.close()
        for t in transports:
            t.close()


RESUME = textwrap.dedent("""
    import json, sys
    from libs.engine import Engine, SamplingSpec
    ckpt, prompt, generated, n = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
    engine = Engine.from_checkpoint(ckpt, max_batch_size=2, max_seq_len=128, eos_token_ids=())
    engine.add_request("moved", prompt, SamplingSpec(temperature=0, max_tokens=n), generated_ids=generated)
    out = []
    while engine.has_work():
        out += [o.token_id for o in engine.step()]
    print(json.dumps(out))
""")


def test_hand_over_to_another_worker_process(four_blocks, expected):
    at = 5
    proc = subprocess.run([sys.executable, "-c", RESUME, str(four_blocks), json.dumps(PROMPTS[2]),
                           json.dumps(expected[2][:at]), str(MAX_NEW)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expected[2][:at] + json.loads(proc.stdout) == expected[2]


def test_live_pair_fixed_split_across_processes_equals_generate(four_blocks, expected):
    """A live-pair engine (BlitzScale §5.2) with one fixed split for every batch (no ZigZag: no
    per-batch choice of the split, nothing arriving during the run). A loading worker with 3 of
    4 blocks loaded gets `live_pair_split` = 2 (capped at half the model); a separate process
    holding only blocks 0-1 runs them for every batch, reached as a RemoteStage over the data
    plane, and the overloaded instance runs blocks 2-3 on its own full copy. The greedy tokens
    of concurrent requests equal generate()'s."""
    from libs.planning.zigzag import live_pair_split  # the split rule only; the ZigZag scheduler is unused

    index = CheckpointIndex.load(four_blocks)
    split = live_pair_split(loaded_blocks=3, n_blocks=index.n_blocks)
    assert split == 2
    full = {b: load_block(four_blocks, index, b) for b in range(index.n_blocks)}  # the overloaded instance's
    with TcpTransport("overloaded") as t:
        host = subprocess.Popen([sys.executable, "-c", STAGE_HOST, str(four_blocks), "0", str(split), "overloaded",
                                 t.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            address = host.stdout.readline().decode().strip()
            target = RemoteStage(t, "stage-host", address, "stage", slots=8)
            engine = Engine.live_pair(index, full, target, split, max_batch_size=8, max_seq_len=128,
                                      eos_token_ids=())
            assert run_all(engine) == expected
        finally:
            stop_stage_host(host)


def test_engine_benchmark_reports_every_field(four_blocks, hf_dir):
    from benchmarks.bench_engine import BATCHES, run_engine_benchmark

    r = run_engine_benchmark(four_blocks, hf_dir, new_tokens=3, repeat=1)
    assert set(r["decode_tokens_per_s"]) == {str(b) for b in BATCHES}
    assert all(v > 0 for v in r["decode_tokens_per_s"].values())
    assert r["hf_generate_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    assert set(r["pipeline_slowdown"]) == {"2", "4"} and all(v > 0 for v in r["pipeline_slowdown"].values())


def test_a_step_waiting_on_a_silent_stage_ends_when_aborted_not_at_its_timeout(four_blocks):
    """A stage whose worker died without closing its connection never replies: the worker aborts
    the entry's remote calls when it learns so (the planner's stop), and the engine thread is
    free at once, not after the stage timeout (every instance of the worker shares that thread)."""
    index = CheckpointIndex.load(four_blocks)
    blocks = {b: load_block(four_blocks, index, b) for b in range(4)}
    silent = threading.Event()

    class _Silent:  # a stage host that takes the call and never answers
        def __init__(self, stage):
            self.stage, self.slots = stage, stage.slots

        def open(self, request_id):
            return self.stage.open(request_id)

        def close(self, request_id):
            return self.stage.close(request_id)

        def forward(self, request_ids, inputs, q_len, logits_to_keep=0):
            silent.wait(30)
            return self.stage.forward(request_ids, inputs, q_len, logits_to_keep)

    with TcpTransport("entry") as t, TcpTransport("host") as h:
        server = StageServer(h, {"entry": t.address})
        try:
            server.add("stage", _Silent(LocalStage(LayerRange(index, blocks, 2, 4), 8, 128)))
            remote = RemoteStage(t, "host", h.address, "stage", slots=8, timeout_s=30)
            engine = Engine(index, stages=[LocalStage(LayerRange(index, blocks, 0, 2), 8, 128), remote],
                            max_batch_size=8, max_seq_len=128, eos_token_ids=())
            for i, p in enumerate(PROMPTS[:2]):
                engine.add_request(f"r{i}", p, SamplingSpec(temperature=0, max_tokens=4))
            failed: list[BaseException] = []

            def step():
                try:
                    engine.step()
                except BaseException as e:  # noqa: BLE001 - the test looks at it
                    failed.append(e)

            stepping = threading.Thread(target=step)
            stepping.start()
            time.sleep(0.5)
            assert stepping.is_alive()  # waiting on the silent stage
            started = time.monotonic()
            engine.abort_remote_stages("its worker is gone")
            stepping.join(5)
            assert not stepping.is_alive() and time.monotonic() - started < 2.0
            assert failed and "its worker is gone" in str(failed[0])
        finally:
            silent.set()
            server.close()


def test_n_choices_over_a_remote_stage_fork_its_kv_there(four_blocks, expected):
    """n > 1 in a pipeline whose second stage is on another worker (a StageServer over TCP): the
    prompt's KV is copied on that worker too (RemoteStage.fork), the prompt goes through it once,
    and each seeded choice samples as an n=1 request with seed + i through a local engine."""
    index = CheckpointIndex.load(four_blocks)
    blocks = {b: load_block(four_blocks, index, b) for b in range(4)}
    params = SamplingSpec(temperature=1.0, max_tokens=MAX_NEW, seed=3, n=3)
    local = Engine.from_checkpoint(four_blocks, max_batch_size=8, max_seq_len=128, eos_token_ids=())
    want = []
    for c in range(3):
        local.add_request(f"s{c}", PROMPTS[0], SamplingSpec(temperature=1.0, max_tokens=MAX_NEW, seed=3 + c))
        want.append(drain_tokens(local)[f"s{c}"])
    with TcpTransport("entry") as t, TcpTransport("host") as h:
        server = StageServer(h, {"entry": t.address})
        try:
            far = LocalStage(LayerRange(index, blocks, 2, 4), 8, 128)
            prefilled = []
            forward = far.forward
            far.forward = lambda ids, x, q_len, keep=0: (prefilled.append(len(ids) * q_len) if q_len > 1 else None,
                                                          forward(ids, x, q_len, keep))[1]
            server.add("stage", far)
            engine = Engine(index, stages=[LocalStage(LayerRange(index, blocks, 0, 2), 8, 128),
                                           RemoteStage(t, "host", h.address, "stage", slots=8)],
                            max_batch_size=8, max_seq_len=128, eos_token_ids=())
            engine.add_request("r", PROMPTS[0], params)
            got: dict[int, list[int]] = {}
            while engine.has_work():
                for o in engine.step():
                    got.setdefault(o.choice, []).append(o.token_id)
            assert [got[c] for c in range(3)] == want
            assert prefilled == [len(PROMPTS[0])]
            assert far.kv.free_slots == 8  # every choice's slot closed there
        finally:
            server.close()
