"""LLM-Mesh end to end (sharing=mesh): two models share one worker process; a burst of one
must not push the other's tokens past its SLO while shadow validation admits requests, and does
when validation is off. Real processes: NATS, Postgres, registry, planner, load-monitor, one
worker, gateway; the official `openai` client reads the steady model's stream.

The SLOs are set from one full prefill step of the bursty model timed here, again in each trial
(the machine's speed varies): the steady model's slack is shorter than that step, so an
unvalidated burst makes it late, while validation admits bursty requests only as far as the
steady model's headroom allows, as the worker's own profile predicts it.
"""

import asyncio
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch

from libs.admin import deploy_model
from libs.bus.broker import RemoteError, call, make_broker, start_broker
from libs.checkpoint import convert_checkpoint, create_demo_checkpoint
from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes
from libs.engine import Engine, SamplingSpec
from libs.engine.engine import DEFAULT_TOKEN_BUDGET
from libs.planning.mesh import MARGIN, Profile
from libs.planning.mesh_profiles import profile_from_message
from libs.protocol import messages as m
from libs.protocol import subjects
from conftest import fresh_database, wait_for

# Alone: the burst test bounds the steady model's lateness by a third of a bursty step (~0.1 s); with
# two other test processes on two cores the steady stream stalled 1.1-3 s while validation refused
# 56-170 of the burst (CI runs).
pytestmark = [pytest.mark.slow, pytest.mark.alone]

# Long enough that the worker is still decoding it when the burst arrives: alone, the steady
# model runs far ahead of its deadlines (about 1.5 ms a token here), and with 120 tokens a slow
# burst sometimes found it done.
STEADY_TOKENS = 300
# A burst of 32 prompts (about four full prefill steps): however its requests trickle in, a
# backlog forms, so unvalidated its full steps come back to back (with 16 on a fast machine the
# engine thread took them a few at a time and the steady model's slack absorbed every step).
BURST, BURST_PROMPT, BURST_TOKENS = 32, 250, 8
PROFILE_MAX_LEN = 256
# The burst's prompts one engine step prefills together (its token budget): the step that a
# backlog of them costs the worker, and what the SLOs are made of.
FULL_STEP = DEFAULT_TOKEN_BUDGET // BURST_PROMPT
STEP_REPEATS = 5


def _burst_prompt(k: int) -> list[int]:
    return [(7 + 13 * i + 101 * k) % 500 + 1 for i in range(BURST_PROMPT)]


@contextmanager
def _one_torch_thread():
    """Engines here run on one torch thread, as the workers do (several, on a crowded machine,
    took 10 s for the steady prompt's 300 tokens, 0.2 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    engine = Engine.from_checkpoint(checkpoints["steady"], max_batch_size=1, max_seq_len=512)
    for k in range(50):
        prompt = [1, 17 + k, 200, 45 + k]
        engine.add_request("p", prompt, SamplingSpec(temperature=0, max_tokens=STEADY_TOKENS))
        outs = []
        with _one_torch_thread():
            while engine.has_work():
                outs += engine.step()
        if outs[-1].finish_reason == "length":
            return prompt
    raise AssertionError("no prompt keeps the steady model from ending early")


class FullStep:
    """One engine step prefilling FULL_STEP burst prompts (batched, as the worker's engine takes a
    backlog of them), timed here on one torch thread as the workers run. `least`: the least time of
    every measurement so far; another process on the cores only adds to a step, so it is the step
    on a quiet machine, and at most what the worker's steps take in the burst. (The SLOs once came
    from a profile's median times extrapolated from 256-token prompts to 2048: measured while CI's
    three test processes started, it made the step 5.96 s, and a 0.3 s step was never late.)"""

    def __init__(self, checkpoint: Path):
        self.engine = Engine.from_checkpoint(checkpoint, max_batch_size=FULL_STEP, max_seq_len=BURST_PROMPT + 4)
        self.least = float("inf")

    def measure(self, repeats: int) -> float:
        """The least of `repeats` steps timed now (`least` takes them in too)."""
        now = float("inf")
        with _one_torch_thread():
            for k in range(repeats):
                ids = [f"step{k}-{j}" for j in range(FULL_STEP)]
                for j, rid in enumerate(ids):
                    self.engine.add_request(rid, _burst_prompt(j), SamplingSpec(temperature=0, max_tokens=2))
                started = time.perf_counter()
                self.engine.step()
                now = min(now, time.perf_counter() - started)
                for rid in ids:
                    self.engine.cancel(rid)
        self.least = min(self.least, now)
        return now


@pytest.fixture(scope="module")
def full_step(checkpoints) -> FullStep:
    step = FullStep(checkpoints["bursty"])
    step.measure(STEP_REPEATS)
    return step


def _slos(step: float) -> dict[str, tuple[float, float]]:
    """(TTFT, TPOT) SLOs per model: the steady model's slack at the start (its TTFT SLO) is half
    of one bursty step, and its TPOT SLO lets it gain a sixteenth of a step per token."""
    return {"steady": (step / 2, step / 16), "bursty": (step / 2, 2 * step)}


def _stored_profile(nats_url: str, model: str) -> Profile | None:
    """`model`'s CPU profile in the registry (what the worker measured and validates with); None
    until it is there."""
    async def get() -> Profile | None:
        broker = make_broker(nats_url)
        await start_broker(broker)
        try:
            return profile_from_message(await call(broker, subjects.REGISTRY_PROFILE_GET,
                                                   m.ProfileRef(model=model, device="cpu"), m.ModelProfile,
                                                   timeout=2.0))
        except (TimeoutError, RemoteError):
            return None
        finally:
            await broker.stop()
    return asyncio.run(get())


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


@dataclass
class Trial:
    state: object
    client: openai.OpenAI
    step: float  # seconds of a full bursty prefill step (FullStep)
    slos: dict[str, tuple[float, float]]
    predicted: float  # what the worker's stored profile makes of that step (shadow validation's view)


@contextmanager
def mesh_cluster(tmp_path_factory, postgres_server_url, nats_url, checkpoints, full_step: FullStep,
                 validation: bool):
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
            # Timed again in every trial (the cluster up, nothing loaded yet). Unvalidated, the
            # least step seen (one more chance of a quiet moment, should the machine have been
            # crowded whenever it was timed before): the burst's steps take at least that, so a
            # steady model on time is not an SLO made too long. Validated, the step as the machine
            # runs now: the lateness allowed (a third of it) grows with a crowded machine's noise,
            # while the worker's profile must still predict the step (the test leaves out a trial
            # where it does not).
            now = full_step.measure(3)
            step = now if validation else full_step.least
            slos = _slos(step)
            for name, path in checkpoints.items():
                ttft, tpot = slos[name]
                deploy_model(state, name, path, min_instances=1, max_instances=1, keep_alive_s=600,
                             ttft_slo_s=ttft, tpot_slo_s=tpot)
            client = openai.OpenAI(base_url=state.gateway_url + "/v1", api_key=state.api_key, timeout=120)
            for name in checkpoints:  # both served, both profiled by the worker (the registry has them)
                wait_for(lambda: client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=1), 120,
                         f"{name} to serve")
            profiles = {name: wait_for(lambda: _stored_profile(nats_url, name), 120, f"the profile of {name}")
                        for name in checkpoints}
            yield Trial(state, client, step, slos, profiles["bursty"].prefill_time(FULL_STEP * BURST_PROMPT))
        finally:
            stop_processes(state.processes)


# The burst runs in a process of its own: its client in the measuring process would hold the GIL
# from the thread that reads the steady stream, and delay the tokens it times (by up to 0.25 s on 2
# cores, seen as lateness the worker never caused). It connects first (one connection a request),
# then fires on a line on stdin, and prints how each bursty request ended. Plain asyncio httpx with
# the bodies made beforehand: the requests leave at once (32 openai clients in threads took long
# enough under load that the steady model, banking a sixteenth of a step a token, was far ahead
# when they came).
_BURST_CLIENT = """
import asyncio, json, sys
import httpx
base_url, api_key, burst, prompt_len, max_tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
bodies = [json.dumps({"model": "bursty", "prompt": [(7 + 13 * i + 101 * k) % 500 + 1 for i in range(prompt_len)],
                      "max_tokens": max_tokens, "temperature": 0}).encode() for k in range(burst)]
async def main():
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=burst),
                                 headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
                                 ) as client:
        for r in await asyncio.gather(*(client.get("models") for _ in range(burst))):
            r.raise_for_status()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        async def bursty(body):
            r = await client.post("completions", content=body)
            r.raise_for_status()
            return r.json()["choices"][0]["finish_reason"]
        print(json.dumps(await asyncio.gather(*map(bursty, bodies))), flush=True)
asyncio.run(main())
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
        validation, tmp_path_factory, postgres_server_url, nats_url, checkpoints, full_step, steady_prompt):
    # The validated case runs three times at most: a lone noisy run of the shared 2-core machine once
    # made a steady token 0.136 s late (bound 0.124 s), and in a CI run (three test processes) the
    # steady stream once stalled 1.1 s with 95 of the burst refused and 0.32 s steps; without
    # validation every run is about a step late. The unvalidated case too: on a quiet machine one run's burst once left the steady model only
    # 0.116 s late (step 0.315 s), and under load a burst that reaches the worker late finds it far
    # ahead (its slack grows a sixteenth of a step a token): three runs at most there. Each run's
    # figures are printed and every failure names them all. The refusals (none without
    # validation) are asserted every run.
    figures: list[str] = []
    worst = step = None  # of the last trial run
    for trial in range(3):
        with mesh_cluster(tmp_path_factory, postgres_server_url, nats_url, checkpoints, full_step,
                          validation) as t:
            figures.append(f"trial {trial}: bursty step {t.step:.3f} s, the worker's profile makes it "
                           f"{t.predicted:.3f} s")
            # Validation keeps the steady model on time only as well as the worker's profile predicts
            # the burst's steps. A profile whose full step (with the margin) falls short of the one
            # timed here by more than the lateness allowed (a third) was taken on a crowded machine
            # (its 2000-token prefill is extrapolated from 128 and 256 tokens: noise at 128 alone
            # shrinks it): not the behaviour under test; that trial is left out and said.
            if validation and (1 + MARGIN) * t.predicted < t.step * 2 / 3:
                figures[-1] += ": the profile understates the step, not run"
                continue
            ttft, tpot = t.slos["steady"]
            lateness, ends = _steady_lateness(t.client, steady_prompt, ttft, tpot)
            if not validation:  # the live steps refreshed both profiles (every 2 s here) while they served
                wait_for(lambda: all(_refreshes(t.state, name) > 0 for name in checkpoints), 10,
                         "live profile refreshes")
            refused = _busy_refusals(t.state)
            # The worker's refusals reach the planner (its next report), which then puts no new
            # instance on it for a while.
            if refused:
                wait_for(lambda: _metric(t.state, "planner", "layercast_planner_busy_worker_reports_total") > 0, 10,
                         "the planner to hear of the worker's refusals")
            else:
                assert _metric(t.state, "planner", "layercast_planner_busy_worker_reports_total") == 0
        worst, step = max(lateness), t.step
        # Where the steady stream stalled longest, and how early it was then (its slack then).
        arrivals = [late + ttft + tpot * i for i, late in enumerate(lateness)]
        gap, after = max((b - a, i) for i, (a, b) in enumerate(zip(arrivals, arrivals[1:])))
        figures[-1] += (f"; the steady model's worst token {worst:+.3f} s (its longest wait {gap:.3f} s, after "
                        f"token {after}, {-lateness[after]:.3f} s early), {refused:g} bursty requests refused")
        print(figures[-1])
        assert (refused > 0) == validation, f"{refused} requests refused as busy: {figures}"
        assert len(lateness) >= STEADY_TOKENS
        assert len(ends) == BURST and all(e in ("length", "stop") for e in ends)  # every bursty request served
        if worst <= step / 3 if validation else worst > step / 2:
            break
    if worst is None:
        pytest.skip(f"every trial's profile understated the bursty step (a loaded machine): {figures}")
    if validation:
        # Every steady token by its deadline, up to a third of a bursty step: the client's own
        # hops and a loaded machine's noise, well below what one unvalidated step costs.
        assert worst <= step / 3, f"a steady token came {worst:.3f} s late: {figures}"
    else:
        # Admitted all at once, the burst's prefill step holds the worker past the steady slack.
        assert worst > step / 2, f"the unvalidated burst left the steady model on time: {figures}"
