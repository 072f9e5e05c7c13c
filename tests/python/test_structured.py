"""Structured outputs and tool calls through the official `openai` client.

Over the tests' prompt set, every `json_schema` answer validates against its schema (a real
JSON Schema validator, `jsonschema`), with and without speculative decoding (the shipped
DSpark drafter), while unconstrained requests run in the same batches; greedy constrained
answers are identical with speculation on and off. Tool calls: `tools` / `tool_choice`,
streaming and not, give the same calls; a tool result in the history is accepted.
"""
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from engine_proc import ROOT, start_engine

SCHEMAS = [
    {"type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 60},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 1, "maxItems": 3},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["title", "tags", "rating"], "additionalProperties": False},
    {"type": "object", "properties": {
        "steps": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"n": {"type": "integer"}, "text": {"type": "string", "maxLength": 30}},
            "required": ["n", "text"], "additionalProperties": False}},
        "result": {"type": "string", "enum": ["yes", "no", "unknown"]}},
     "required": ["steps", "result"], "additionalProperties": False},
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]


def prompts():
    lines = (ROOT / "tests" / "peer" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(s)["prompt"][:600] for s in lines if s.strip()]


@pytest.fixture(scope="module")
def engines():
    """A plain engine and one speculating with the shipped drafter."""
    drafter = ROOT / "drafters" / "smollm2-135m-dspark-markov"
    procs = [start_engine(log_name="dspark-structured-plain.log"),
             start_engine(["--speculation", "dspark-markov", "--drafter", str(drafter),
                           "--policy", "fixed", "--gamma", "4"], log_name="dspark-structured-spec.log")]
    yield [OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) for _, url, _ in procs]
    for proc, _, _ in procs:
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()


def constrained(client, i, prompt):
    schema = SCHEMAS[i % len(SCHEMAS)]
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt + "\nAnswer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 3}", "schema": schema, "strict": True}},
        max_tokens=200, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def unconstrained(client, prompt):
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0.8, seed=1)
    return r.choices[0].message.content


def test_every_schema_answer_validates_with_and_without_speculation(engines):
    ps = prompts()
    answers = []
    for client in engines:
        with ThreadPoolExecutor(8) as pool:
            free = [pool.submit(unconstrained, client, p) for p in ps[::4]]
            futs = [pool.submit(constrained, client, i, p) for i, p in enumerate(ps)]
            got = [f.result() for f in futs]
            assert all(isinstance(f.result(), str) for f in free)
        for i, (text, reason, _) in enumerate(got):
            assert reason == "stop", f"prompt {i}: {reason}: {text!r}"
            jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
        answers.append(got)
    plain, spec = answers
    assert [a[0] for a in spec] == [a[0] for a in plain], "speculation changed a constrained answer"
    assert sum(a[2].draft_tokens for a in spec) > 0, "the drafter never drafted"


def test_tool_calls_streaming_and_not(engines):
    client = engines[1]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in {"get_weather", "add"}
    jsonschema.validate(json.loads(call.function.arguments),
                        next(t for t in TOOLS if t["function"]["name"] == call.function.name)["function"]["parameters"])
    # Streamed: the client's own accumulator rebuilds the same call.
    with client.beta.chat.completions.stream(model="smollm2", messages=messages, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=80, temperature=0) as s:
        final = s.get_final_completion()
    (scall,) = final.choices[0].message.tool_calls
    assert (scall.function.name, scall.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"
    # A named function, and the result of the call in the history.
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Add 2 and 40."}],
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                       max_tokens=60, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "add" for c in calls)
    history = messages + [r.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": calls[0].id, "content": "42"}]
    r = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, max_tokens=20, temperature=0)
    assert r.choices[0].finish_reason in {"stop", "length", "tool_calls"}
