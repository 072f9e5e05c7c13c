"""The Responses API, models.retrieve and completions echo with the official `openai` client
against a real engine process (issue #52)."""

import json

import openai
import pytest


@pytest.fixture()
def client(engine_url):
    return openai.OpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0, timeout=300)


CONVERSATION = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_greedy_response_equals_chat(client):
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": "Be brief."}, *CONVERSATION],
        max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    r = client.responses.create(model="smollm2", instructions="Be brief.", input=CONVERSATION,
                                max_output_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 16
    assert r.usage.input_tokens_details.cached_tokens >= 0
    # A string input is one user message; top_p is accepted.
    s = client.responses.create(model="smollm2", input="Name three colors.", max_output_tokens=4,
                                temperature=0, top_p=0.9)
    assert s.output[0].type == "message"


def test_streaming_events(client):
    kwargs = dict(model="smollm2", input="List two fruits.", max_output_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.responses.create(**kwargs).output_text
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == full
    assert events[-1].response.usage.output_tokens == 12


def test_function_calls_round_trip(client):
    r = client.responses.create(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model="smollm2", tools=[WEATHER], max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"celsius": 21}'}])
    assert follow.status in ("completed", "incomplete")
    # Streamed calls come as function_call items with their arguments.
    events = list(client.responses.create(model="smollm2", input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=60, temperature=0,
                                          stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and isinstance(json.loads(done[0].arguments), dict)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(model="smollm2", input="A color as JSON.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema,
                                                 "strict": True}})
    assert isinstance(json.loads(r.output_text)["color"], str)
    r = client.responses.create(model="smollm2", input="A JSON object.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.startswith("{")


def test_previous_response_id_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input="Hi", previous_response_id="resp_123")
    assert "not store" in str(e.value)


def test_models_retrieve(client):
    m = client.models.retrieve("smollm2")
    assert m.id == "smollm2"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"


def test_completions_echo(client):
    kwargs = dict(model="smollm2", prompt="The sky is", max_tokens=5, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(echo=True, **kwargs).choices[0].text
    assert echoed == "The sky is" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kwargs)
                       if c.choices)
    assert streamed == echoed
    with pytest.raises(openai.BadRequestError):
        client.completions.create(echo=True, logprobs=1, **kwargs)
