"""OpenAI sampling parameters end to end, through the real gateway with the official `openai`
client: penalties (presence, frequency, repetition) and logprobs (chat's logprobs/top_logprobs,
completions' legacy logprobs), streamed and not, checked against the engine over the same
checkpoint (for the token ids a seeded or penalized request must produce) and Hugging Face
(for the logprob values: the log-softmax of the model's logits)."""

import asyncio
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from libs.bus.broker import RemoteError, call, make_broker, on_event, start_broker
from libs.engine import Engine, SamplingSpec
from libs.protocol import messages as m
from libs.protocol import subjects
from conftest import TEST_ADMIN_KEY, TEST_API_KEY, generate_on_worker, one_worker_cluster
from conftest_models import reference_model

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = TEST_API_KEY, TEST_ADMIN_KEY
PROMPT = [1, 17, 200, 45, 301, 99, 7, 450, 12, 64]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    # The hand-over test talks to the worker directly: the cluster uses this process's namespace.
    with one_worker_cluster(tmp_path_factory, postgres_server_url, tiny_checkpoint, nats_url, subjects.PREFIX) as state:
        yield state


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key=API_KEY, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)  # the one the gateway loads


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return reference_model(Path(tiny_checkpoint).parent / "hf")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine.from_checkpoint(tiny_checkpoint, max_batch_size=4, max_seq_len=512)


def engine_run(engine: Engine, prompt: list[int], **params) -> list[int]:
    """The token ids the engine (the one the workers run) gives for this request."""
    engine.add_request("ref", prompt, SamplingSpec(**params))
    ids = []
    while engine.has_work():
        ids += [o.token_id for o in engine.step()]
    return ids


def hf_logprobs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: HF's log-softmax at each generated token's position."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(generated)], dim=-1)


def chat_prompt(tokenizer) -> list[int]:
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def test_completions_logprobs_and_penalties_match_the_references(client, tokenizer, hf, engine, tiny_checkpoint):
    params = dict(max_tokens=16, temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    done = client.completions.create(model="tiny", prompt=PROMPT, logprobs=5,
                                     extra_body={"repetition_penalty": 1.2}, **params)
    ids = engine_run(engine, PROMPT, repetition_penalty=1.2, **params)
    assert done.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert done.choices[0].text != plain.choices[0].text  # the penalties were applied
    assert plain.choices[0].logprobs is None  # not asked: not computed
    lp = done.choices[0].logprobs
    want = hf_logprobs(hf, PROMPT, ids)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    for i, top in enumerate(lp.top_logprobs):
        best = torch.topk(want[i], 5)
        expected = {tokenizer.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
        expected.setdefault(lp.tokens[i], float(want[i, ids[i]]))  # the sampled token's, always
        assert top.keys() == expected.keys()
        assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-4)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.text_offset == offsets
    # Streamed: a chunk per token carrying that token's logprobs, the offsets running on.
    chunks = [c for c in client.completions.create(model="tiny", prompt=PROMPT, logprobs=5, stream=True,
                                                   extra_body={"repetition_penalty": 1.2}, **params) if c.choices]
    assert len(chunks) == len(ids)
    assert all(len(c.choices[0].logprobs.tokens) == 1 for c in chunks)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c.choices[0].logprobs, key)] == getattr(lp, key), key
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    # logprobs=0: the sampled token's logprob only.
    zero = client.completions.create(model="tiny", prompt=PROMPT, logprobs=0, max_tokens=4, temperature=0)
    assert [list(d) for d in zero.choices[0].logprobs.top_logprobs] == [[t] for t in zero.choices[0].logprobs.tokens]


def test_chat_logprobs_streamed_and_not_match_the_references(client, tokenizer, hf, engine):
    prompt = chat_prompt(tokenizer)
    params = dict(max_tokens=14, temperature=0.8, seed=1234, presence_penalty=0.6)
    full = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=3, **params)
    assert full.usage.prompt_tokens == len(prompt)
    ids = engine_run(engine, prompt, **params)
    content = full.choices[0].logprobs.content
    assert len(content) == len(ids) == full.usage.completion_tokens
    want = hf_logprobs(hf, prompt, ids)
    for i, (entry, t) in enumerate(zip(content, ids)):
        assert entry.token == tokenizer.decode([t])
        assert entry.logprob == pytest.approx(float(want[i, t]), abs=1e-4)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode() == entry.token
        best = torch.topk(want[i], 3)
        assert [e.token for e in entry.top_logprobs] == [tokenizer.decode([b]) for b in best.indices.tolist()]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
    # The bytes of all tokens are the completion's bytes (a character split across tokens included).
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert full.choices[0].message.content in text
    stream = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=3, stream=True,
                                            **params)
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].logprobs is None  # the role's chunk
    per_token = [c.choices[0].logprobs.content for c in chunks[1:]]
    assert [len(x) for x in per_token] == [1] * len(ids)
    assert [e.model_dump() for x in per_token for e in x] == [e.model_dump() for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    # logprobs without top_logprobs: each token's own, no alternatives; not asked: none.
    bare = client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, max_tokens=3, temperature=0)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[]] * len(bare.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3).choices[0].logprobs is None


def test_chat_penalties_change_the_output_as_the_engine_does(client, tokenizer, engine):
    prompt = chat_prompt(tokenizer)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0)
    assert plain.choices[0].message.content == tokenizer.decode(
        engine_run(engine, prompt, max_tokens=30, temperature=0), skip_special_tokens=True)
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=-2.0), dict(repetition_penalty=1.5)):
        extra = {"repetition_penalty": kw.pop("repetition_penalty")} if "repetition_penalty" in kw else {}
        out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0,
                                             extra_body=extra, **kw)
        ids = engine_run(engine, prompt, max_tokens=30, temperature=0, **kw, **extra)
        assert out.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True), (kw, extra)
        assert out.choices[0].message.content != plain.choices[0].message.content, (kw, extra)


def test_min_p_samples_as_the_engine_does_and_at_1_keeps_only_the_likeliest_token(client, tokenizer, engine):
    params = dict(max_tokens=16, temperature=1.0, seed=5)
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    likeliest = client.completions.create(model="tiny", prompt=PROMPT, extra_body={"min_p": 1.0}, **params)
    assert likeliest.choices[0].text == greedy.choices[0].text
    free = client.completions.create(model="tiny", prompt=PROMPT, **params)
    cut = client.completions.create(model="tiny", prompt=PROMPT, extra_body={"min_p": 0.5}, **params)
    assert cut.choices[0].text == tokenizer.decode(engine_run(engine, PROMPT, min_p=0.5, **params),
                                                   skip_special_tokens=True)
    assert cut.choices[0].text != free.choices[0].text  # min_p changed what was sampled


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"presence_penalty": -2.01}, "presence_penalty"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "logprobs"),  # the prompt's logprobs: not computed
    ("/v1/completions", {"n": 9}, "n"),  # above LAYERCAST_MAX_N (8 by default)
    ("/v1/chat/completions", {"n": 9}, "n"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"min_p": -0.1}, "min_p"),
])
def test_out_of_range_parameters_are_a_400_naming_them(cluster, path, body, param):
    base = ({"model": "tiny", "messages": CHAT} if "chat" in path else {"model": "tiny", "prompt": "x"})
    r = httpx.post(cluster.gateway_url + path, json={**base, "max_tokens": 2, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param



def test_echo_gives_back_the_prompt_given_as_text_or_as_ids(client, tokenizer):
    text = tokenizer.decode(PROMPT)
    for prompt in (PROMPT, text):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True)
        alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
        assert out.choices[0].text == text + alone.choices[0].text


def test_a_handed_over_request_keeps_its_penalties_and_logprobs(cluster):
    """The message a hand-over sends (GenerateRequest with generated_ids, the same SamplingSpec),
    sent by the test to the serving worker: the resumed request counts the tokens it generated
    before for its penalties, and goes on with the same tokens and logprobs as one whole run."""
    admin = httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    (inst,) = [i for i in admin.get("/admin/v1/cluster").json()["instances"]
               if i["model"] == "tiny" and i["state"] == "ready"]
    spec = m.SamplingSpec(temperature=0, max_tokens=16, frequency_penalty=0.8, presence_penalty=0.3,
                          repetition_penalty=1.3, logprobs=3)

    def generate(generated: list[int]) -> list[m.TokenEvent]:
        return generate_on_worker(cluster.nats_url, inst["stages"][0]["worker_id"], inst["instance_id"], PROMPT,
                                  spec, generated)

    full = generate([])
    assert not any(e.error for e in full) and len(full) == 16
    assert all(e.logprob is not None and len(e.top_logprobs) == 3 for e in full)
    tokens = [e.token_id for e in full]
    for at in (3, 9):
        resumed = generate(tokens[:at])
        assert [e.index for e in resumed] == list(range(at, 16))
        assert tokens[:at] + [e.token_id for e in resumed] == tokens
        assert [e.logprob for e in resumed] == pytest.approx([e.logprob for e in full[at:]], abs=1e-4)
        assert [[t for t, _ in e.top_logprobs] for e in resumed] == [[t for t, _ in e.top_logprobs]
                                                                    for e in full[at:]]


def test_n_completions_non_streamed_and_streamed_are_the_engines_choices(client, tokenizer, engine):
    """n=3 with a seed: choice i is what the engine samples with seed + i (the prompt prefilled
    once on the worker, its KV copied to each choice), streamed and not, with usage summed."""
    params = dict(max_tokens=12, temperature=1.0, seed=42)
    want = [engine_run(engine, PROMPT, **{**params, "seed": 42 + i}) for i in range(3)]
    assert len({tuple(w) for w in want}) == 3
    texts = [tokenizer.decode(w, skip_special_tokens=True) for w in want]
    done = client.completions.create(model="tiny", prompt=PROMPT, n=3, logprobs=1, **params)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == texts
    assert [len(c.logprobs.tokens) for c in done.choices] == [len(w) for w in want]
    assert all(c.finish_reason in ("stop", "length") for c in done.choices)
    assert done.usage.prompt_tokens == len(PROMPT)
    assert done.usage.completion_tokens == sum(map(len, want))
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, n=3, stream=True,
                                            stream_options={"include_usage": True}, **params))
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens and not chunks[-1].choices
    per = {i: [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in range(3)}
    assert set(per) == {c.choices[0].index for c in chunks if c.choices}
    assert ["".join(x.text for x in per[i]) for i in range(3)] == texts
    assert [[x.finish_reason for x in per[i] if x.finish_reason] for i in range(3)] == [
        [c.finish_reason] for c in done.choices]


def test_n_chat_completions_non_streamed_and_streamed(client, tokenizer, engine):
    prompt = chat_prompt(tokenizer)
    params = dict(max_tokens=10, temperature=0.9, seed=7)
    want = [engine_run(engine, prompt, **{**params, "seed": 7 + i}) for i in range(3)]
    texts = [tokenizer.decode(w, skip_special_tokens=True) for w in want]
    full = client.chat.completions.create(model="tiny", messages=CHAT, n=3, logprobs=True, **params)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.message.content for c in full.choices] == texts
    assert [len(c.logprobs.content) for c in full.choices] == [len(w) for w in want]
    assert full.usage.prompt_tokens == len(prompt) and full.usage.completion_tokens == sum(map(len, want))
    stream = list(client.chat.completions.create(model="tiny", messages=CHAT, n=3, stream=True, **params))
    per = {i: [c.choices[0] for c in stream if c.choices[0].index == i] for i in range(3)}
    assert set(per) == {c.choices[0].index for c in stream}
    assert all(per[i][0].delta.role == "assistant" for i in range(3))  # each choice's first chunk
    assert ["".join(x.delta.content or "" for x in per[i]) for i in range(3)] == texts
    assert [[x.finish_reason for x in per[i] if x.finish_reason] for i in range(3)] == [
        [c.finish_reason] for c in full.choices]
    # Greedy: every choice is the one greedy completion.
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=8, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_a_handed_over_n_request_resumes_its_unfinished_choices(cluster):
    """The hand-over message of an n > 1 request: `choices` names the choices still running
    with their tokens so far; each goes on from its own index, an ended one is not run again."""
    admin = httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    (inst,) = [i for i in admin.get("/admin/v1/cluster").json()["instances"]
               if i["model"] == "tiny" and i["state"] == "ready"]
    worker = inst["stages"][0]["worker_id"]
    spec = m.SamplingSpec(temperature=0, max_tokens=10, n=3, stop_token_ids=[])
    full = generate_on_worker(cluster.nats_url, worker, inst["instance_id"], PROMPT, spec)
    assert not any(e.error for e in full)
    runs = {c: [e.token_id for e in full if e.choice == c] for c in range(3)}
    tokens = runs[0]
    assert runs[1] == runs[2] == tokens and len(tokens) > 4  # greedy: n equal choices
    assert [e.index for e in full if e.choice == 1] == list(range(len(tokens)))
    resumed = generate_on_worker(cluster.nats_url, worker, inst["instance_id"], PROMPT, spec,
                                 choices={0: tokens[:4], 2: []})
    assert not any(e.error for e in resumed) and {e.choice for e in resumed} == {0, 2}
    assert [e.index for e in resumed if e.choice == 0] == list(range(4, len(tokens)))
    assert tokens[:4] + [e.token_id for e in resumed if e.choice == 0] == tokens
    assert [e.token_id for e in resumed if e.choice == 2] == tokens
    assert [e.finished for e in resumed].count(True) == 2


def test_a_cancelled_attempt_is_refused_when_its_generate_comes_late_and_no_other_attempt_is_cancelled(cluster):
    """The gateway cancels an attempt it stopped waiting for (an overloaded worker may take it
    late): the worker refuses that attempt's generate when it comes after the cancel, and a
    cancel naming one attempt leaves another attempt of the same request running."""
    admin = httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    (inst,) = [i for i in admin.get("/admin/v1/cluster").json()["instances"]
               if i["model"] == "tiny" and i["state"] == "ready"]
    worker, request_id = inst["stages"][0]["worker_id"], f"late-{uuid.uuid4().hex[:8]}"
    reply = f"{subjects.PREFIX}.test.tokens.{request_id}"

    async def run() -> tuple[str, list[m.TokenEvent]]:
        broker = make_broker(cluster.nats_url)
        events: list[m.TokenEvent] = []
        done = asyncio.Event()

        @broker.subscriber(reply)
        @on_event(m.TokenEvent)
        async def token(ev: m.TokenEvent) -> None:
            events.append(ev)
            if ev.finished:
                done.set()

        def cancel(attempt: int):
            return broker.publish(m.CancelRequest(request_id=request_id, instance_id=inst["instance_id"],
                                                  attempt=attempt).model_dump(mode="json"),
                                  subjects.worker_cancel(worker))

        def generate(attempt: int):
            req = m.GenerateRequest(request_id=request_id, instance_id=inst["instance_id"], model="tiny",
                                    prompt_ids=PROMPT, reply_subject=reply, attempt=attempt,
                                    sampling=m.SamplingSpec(temperature=0, max_tokens=40, stop_token_ids=[]))
            return call(broker, subjects.worker_generate(worker), req, m.GenerateAccepted)

        await start_broker(broker)
        try:
            await cancel(0)
            await asyncio.sleep(0.5)  # the cancel is there first
            try:
                await generate(0)
                refused = "accepted"
            except RemoteError as e:
                refused = e.code
            await generate(1)
            for _ in range(3000):
                if sum(e.token_id is not None for e in events) >= 2:
                    break
                await asyncio.sleep(0.01)
            await cancel(0)  # attempt 0's again: attempt 1 runs on
            await asyncio.wait_for(done.wait(), 30)
            return refused, events
        finally:
            await broker.stop()

    refused, events = asyncio.run(run())
    assert refused == "conflict"
    assert not any(e.error for e in events) and events[-1].finish_reason == "length"
    assert [e.index for e in events if e.token_id is not None] == list(range(40))
