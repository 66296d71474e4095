"""LLM-Mesh end to end (sharing=mesh): two models share one worker process; a burst of one
must not push the other's tokens past its SLO while shadow validation admits requests, and does
when validation is off. Real processes: NATS, Postgres, registry, planner, load-monitor, one
worker, gateway; the official `openai` client.

The SLOs are set from a profile of the two checkpoints measured here first (the machine's speed
varies): the steady model's slack is shorter than one full prefill step of the bursty model, so
an unvalidated burst makes it late, while validation admits bursty requests only as far as the
steady model's headroom allows.
"""

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch

from libs.admin import deploy_model
from libs.checkpoint import CheckpointIndex, convert_checkpoint, create_demo_checkpoint, load_block
from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes
from libs.engine import Engine
from libs.engine.profiling import measure_profile
from libs.protocol import subjects
from benchmarks.bench_mesh import profile_stored
from conftest import fresh_database, wait_for

pytestmark = pytest.mark.slow

# Long enough that the worker is still decoding it when the burst arrives: alone, the steady
# model runs far ahead of its deadlines (about 1.5 ms a token here), and with 120 tokens a slow
# burst sometimes found it done.
STEADY_TOKENS = 300
# A burst of 32 prompts (about four full prefill steps): however its requests trickle in, a
# backlog forms, so unvalidated its full steps come back to back (with 16 on a fast machine the
# engine thread took them a few at a time and the steady model's slack absorbed every step).
BURST, BURST_PROMPT, BURST_TOKENS = 32, 250, 8
PROFILE_MAX_LEN = 256


def _checkpoint(root: Path, preset: str, seed: int) -> Path:
    hf = create_demo_checkpoint(root / "hf", preset=preset, arch="llama", seed=seed)
    convert_checkpoint(hf, root / "blocks", 2)
    return root / "blocks"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mesh-models")
    return {"steady": _checkpoint(root / "steady", "tiny", 0), "bursty": _checkpoint(root / "bursty", "small", 1)}


@pytest.fixture(scope="module")
def steady_prompt(checkpoints) -> list[int]:
    """A prompt the steady model answers with STEADY_TOKENS tokens before any end token (greedy)."""
    from libs.engine import SamplingSpec

    engine = Engine.from_checkpoint(checkpoints["steady"], max_batch_size=1, max_seq_len=512)
    for k in range(50):
        prompt = [1, 17 + k, 200, 45 + k]
        engine.add_request("p", prompt, SamplingSpec(temperature=0, max_tokens=STEADY_TOKENS))
        outs = []
        while engine.has_work():
            outs += engine.step()
        if outs[-1].finish_reason == "length":
            return prompt
    raise AssertionError("no prompt keeps the steady model from ending early")


@pytest.fixture(scope="module")
def bursty_step(checkpoints) -> float:
    """Seconds of one engine step's full prefill budget of bursty prompts, from a profile
    measured in this process (one torch thread, as the workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        index = CheckpointIndex.load(checkpoints["bursty"])
        blocks = {b.id: load_block(checkpoints["bursty"], index, b.id) for b in index.blocks}
        bursty = measure_profile(lambda b, n: Engine(index, blocks, max_batch_size=b, max_seq_len=n,
                                                     kv_cache_bytes=1 << 40), PROFILE_MAX_LEN, 2, repeats=3)
    finally:
        torch.set_num_threads(threads)
    return bursty.prefill_time(2048)


@pytest.fixture(scope="module")
def slos(bursty_step) -> dict[str, tuple[float, float]]:
    """(TTFT, TPOT) SLOs per model: the steady model's slack at the start (its TTFT SLO) is half
    of one bursty step, and its TPOT SLO lets it gain a sixteenth of a step per token."""
    return {"steady": (bursty_step / 2, bursty_step / 16), "bursty": (bursty_step / 2, 2 * bursty_step)}


def _metric(state, process: str, name: str, **labels: str) -> float:
    """The sum of a counter's samples on one of the cluster's processes (those with all `labels`)."""
    [p] = [p for p in state.processes if p.name.startswith(process)]
    text = httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _refreshes(state, model: str) -> float:
    return _metric(state, "worker", "layercast_worker_mesh_profile_refreshes_total", model=model)


def _busy_refusals(state) -> float:
    """Requests the worker refused as busy: every verdict but an admission."""
    return sum(_metric(state, "worker", "layercast_worker_mesh_admissions_total", verdict=v)
               for v in ("new_prefill_late", "existing_late", "node_tpot_exceeded"))


@contextmanager
def mesh_cluster(tmp_path_factory, postgres_server_url, nats_url, checkpoints, slos, validation: bool):
    with fresh_database(postgres_server_url) as db:
        state = start_cluster(ClusterSpec(
            state_dir=tmp_path_factory.mktemp("mesh-cluster"), port=free_port(), database_url=db, workers=1,
            nats_url=nats_url, namespace=subjects.PREFIX, heartbeat_ttl_s=2.0,
            extra_env={"LAYERCAST_SHARING": "mesh", "LAYERCAST_SHADOW_VALIDATION": "1" if validation else "0",
                       "LAYERCAST_PROFILE_MAX_LEN": str(PROFILE_MAX_LEN),
                       # Validated: elastic KV (a growth's stall counted). Unvalidated: KV fixed (the
                       # default), so the burst reaches the engine at once (growing the KV per request
                       # admits it a few requests per step, which softens it: not what this run shows).
                       "LAYERCAST_KV_MIN_SLOTS": "1" if validation else "0",
                       # Live refresh only where it cannot move admission (validation off): on, it
                       # left the validated steady model 0.10-0.14 s late (see the worker's default).
                       "LAYERCAST_PROFILE_REFRESH_S": "0" if validation else "2"}))
        try:
            for name, path in checkpoints.items():
                ttft, tpot = slos[name]
                deploy_model(state, name, path, min_instances=1, max_instances=1, keep_alive_s=600,
                             ttft_slo_s=ttft, tpot_slo_s=tpot)
            client = openai.OpenAI(base_url=state.gateway_url + "/v1", api_key=state.api_key, timeout=120)
            for name in checkpoints:  # both served, both profiled by the worker (the registry has them)
                wait_for(lambda: client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=1), 120,
                         f"{name} to serve")
                wait_for(lambda: profile_stored(nats_url, subjects.PREFIX, name), 120, f"the profile of {name}")
            yield state, client
        finally:
            stop_processes(state.processes)


# The burst runs in a process of its own: its 32 client threads in the measuring process would
# hold the GIL from the thread that reads the steady stream, and delay the tokens it times (by up
# to 0.25 s on 2 cores, seen as lateness the worker never caused). It imports and connects first,
# then fires on a line on stdin, and prints how each bursty request ended.
_BURST_CLIENT = """
import concurrent.futures, json, sys
import openai
base_url, api_key, burst, prompt_len, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=120)
def bursty(k):
    prompt = [(7 + 13 * i + 101 * k) % 500 + 1 for i in range(prompt_len)]
    r = client.completions.create(model="bursty", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].finish_reason
print("ready", flush=True)
sys.stdin.readline()
with concurrent.futures.ThreadPoolExecutor(burst) as pool:
    print(json.dumps(list(pool.map(bursty, range(burst)))), flush=True)
"""


def _steady_lateness(client: openai.OpenAI, prompt: list[int], ttft: float,
                     tpot: float) -> tuple[list[float], list[str]]:
    """Run the steady stream with the burst starting after its first tokens: each steady token's
    lateness against eq. 1's deadline ST + TTFT_SLO + TPOT_SLO * O (negative: early), and how
    each bursty request ended."""
    burst = subprocess.Popen([sys.executable, "-c", _BURST_CLIENT, str(client.base_url), client.api_key, str(BURST),
                              str(BURST_PROMPT), str(BURST_TOKENS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert burst.stdout.readline().strip() == "ready"
        started = time.monotonic()
        lateness: list[float] = []
        stream = client.completions.create(model="steady", prompt=prompt, max_tokens=STEADY_TOKENS, temperature=0,
                                           stream=True)
        for chunk in stream:
            if not chunk.choices:
                continue
            lateness.append(time.monotonic() - (started + ttft + tpot * len(lateness)))
            if len(lateness) == 3:
                burst.stdin.write("go\n")
                burst.stdin.flush()
        out, _ = burst.communicate(timeout=300)
    finally:
        burst.kill()
    assert burst.returncode == 0, "the burst's client failed"
    return lateness, json.loads(out)


@pytest.mark.parametrize("validation", [True, False], ids=["validated", "unvalidated"])
def test_a_burst_of_one_model_does_not_make_the_other_late_while_shadow_validation_admits(
        validation, tmp_path_factory, postgres_server_url, nats_url, checkpoints, slos, bursty_step,
        steady_prompt):
    step = bursty_step
    # The validated case runs twice at most: a lone noisy run of the shared 2-core machine once made
    # a steady token 0.136 s late (bound 0.124 s); without validation every run is about a step late.
    # The unvalidated case too: on a quiet machine one run's burst once left the steady model only
    # 0.116 s late (step 0.315 s), and a CI run twice left it early (its slack grows a sixteenth of
    # a step a token, so a burst that reaches the worker late finds it far ahead): three runs at
    # most there. The refusals (none without validation) are asserted every run.
    for trial in range(2 if validation else 3):
        with mesh_cluster(tmp_path_factory, postgres_server_url, nats_url, checkpoints, slos,
                          validation) as (state, client):
            ttft, tpot = slos["steady"]
            lateness, ends = _steady_lateness(client, steady_prompt, ttft, tpot)
            if not validation:  # the live steps refreshed both profiles (every 2 s here) while they served
                wait_for(lambda: all(_refreshes(state, name) > 0 for name in checkpoints), 10,
                         "live profile refreshes")
            refused = _busy_refusals(state)
            # The worker's refusals reach the planner (its next report), which then puts no new
            # instance on it for a while.
            if refused:
                wait_for(lambda: _metric(state, "planner", "layercast_planner_busy_worker_reports_total") > 0, 10,
                         "the planner to hear of the worker's refusals")
            else:
                assert _metric(state, "planner", "layercast_planner_busy_worker_reports_total") == 0
        assert (refused > 0) == validation, f"{refused} requests refused as busy"
        assert len(lateness) >= STEADY_TOKENS
        assert len(ends) == BURST and all(e in ("length", "stop") for e in ends)  # every bursty request served
        worst = max(lateness)
        if worst <= step / 3 if validation else worst > step / 2:
            break
    if validation:
        # Every steady token by its deadline, up to a third of a bursty step: the client's own
        # hops and a loaded machine's noise, well below what one unvalidated step costs.
        assert worst <= step / 3, f"a steady token came {worst:.3f} s late (a bursty step: {step:.3f} s)"
    else:
        # Admitted all at once, the burst's prefill step holds the worker past the steady slack.
        assert worst > step / 2, f"the unvalidated burst left the steady model on time (worst {worst:.3f} s)"
