"""The official `openai` Python client against a real engine process."""

import openai
import pytest


@pytest.fixture()
def client(engine_url):
    return openai.OpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["smollm2"]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(
        model="default",
        messages=[{"role": "user", "content": "List two fruits."}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(parts) == full
    assert usage.completion_tokens == 16
    assert finish == "length"


def test_completions_streaming_and_not(client):
    r = client.completions.create(model="smollm2", prompt="def square(x):", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = r.choices[0].text
    assert r.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model="smollm2", prompt="def square(x):", max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        if c.choices
    )
    assert streamed == text


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=100000)
    assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], n=99)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}],
                                       presence_penalty=3)
    assert e.value.body["param"] == "presence_penalty"


def test_n_choices_penalties_and_logit_bias(client):
    """The parameters LangChain and other SDKs send: n, penalties, logit_bias (and vLLM's
    min_p / repetition_penalty as extra_body)."""
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=8,
        n=3,
        seed=11,
        temperature=1.0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"28": -100},
        extra_body={"min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content for c in r.choices)
    assert 3 <= r.usage.completion_tokens <= 24
    # Streaming: every choice ends once.
    ends = {}
    for chunk in client.completions.create(model="smollm2", prompt=["Hello", "Goodbye"], n=2, max_tokens=4,
                                           temperature=0.7, seed=3, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                ends[c.index] = ends.get(c.index, 0) + 1
    assert ends == {0: 1, 1: 1, 2: 1, 3: 1}


def test_structured_outputs_with_parse(client):
    """`beta.chat.completions.parse` with a Pydantic model: the server constrains the output
    to the model's JSON schema, so the client parses it into the model."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    r = client.beta.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Give the name and country of the capital of France."}],
        response_format=City,
        max_tokens=60,
        temperature=0,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert city.name and city.country
    # The same, streamed: the client's stream helper parses the final message into the model,
    # and the streamed text is the non-streamed answer (greedy).
    with client.beta.chat.completions.stream(
        model="smollm2",
        messages=[{"role": "user", "content": "Give the name and country of the capital of France."}],
        response_format=City,
        max_tokens=60,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    streamed = final.choices[0].message.parsed
    assert isinstance(streamed, City), final.choices[0].message.content
    assert streamed == city
    assert "".join(deltas) == r.choices[0].message.content
    # json_object through the plain client, streamed.
    parts = []
    for chunk in client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Give a short JSON object with the name and country of Paris."}],
            response_format={"type": "json_object"}, max_tokens=200, temperature=0, stream=True):
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
    import json
    assert isinstance(json.loads("".join(parts)), dict)
