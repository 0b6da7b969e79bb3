"""The official Python ``openai`` SDK against a real local cluster (llama.cpp, SmolLM2): every
request field an OpenAI client sends either shows its effect here or is refused by name."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from ops.local_cluster import LocalCluster
from tests.conformance.conftest import CHAT_MODEL, EMBED_MODEL
from tests.conformance.refused import REFUSED

pytestmark = pytest.mark.timeout(600)

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "utc": {"type": "boolean"}},
            "required": ["city", "utc"],
        },
    },
}
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_required_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    schema = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(arguments, schema)  # the grammar follows the function's schema

    history: list[ChatCompletionMessageParam] = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    final = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=history,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=40,
        temperature=0,
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str) and final.choices[0].message.content


def test_a_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120,
        temperature=0,
    )
    calls = answer.choices[0].message.tool_calls
    assert calls is not None and isinstance(calls[0], ChatCompletionMessageFunctionToolCall)
    assert calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME["function"]["parameters"])


def test_streamed_tool_call_deltas_are_reassembled_by_the_sdk(client: openai.OpenAI) -> None:
    fragments = 0
    with client.chat.completions.stream(
        model=CHAT_MODEL,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    ) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                fragments += len(event.chunk.choices[0].delta.tool_calls or ())
        final = stream.get_final_completion()
    assert fragments >= 2  # the name first, then the arguments in pieces
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_json_schema_answer_validates(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "strict": True, "schema": PERSON},
        },
        max_tokens=100,
        temperature=0,
    )
    content = answer.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), PERSON)


def test_a_request_llama_server_refuses_is_a_400_not_a_502(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=CHAT_MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "broken", "schema": {"$ref": "#/definitions/nowhere"}},
            },
            max_tokens=10,
        )
    assert refused.value.code == "invalid_request"
    assert "cannot resolve $ref" in refused.value.message


def test_a_json_object_answer_parses(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object with a key named color."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert isinstance(json.loads(answer.choices[0].message.content or ""), dict)


def _well_formed(entries: Any, top: int) -> None:
    assert entries
    for entry in entries:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert entry.bytes is None or all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == top
        assert all(t.logprob <= 0 and isinstance(t.token, str) for t in entry.top_logprobs)


def test_logprobs_are_well_formed_streamed_and_not(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=5,
        temperature=0,
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    _well_formed(logprobs.content, 2)
    assert len(logprobs.content) == answer.usage.completion_tokens  # type: ignore[union-attr]
    streamed = []
    for chunk in client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=5,
        temperature=0,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed.extend(chunk.choices[0].logprobs.content)
    _well_formed(streamed, 2)
    assert [e.token for e in streamed] == [e.token for e in logprobs.content]


def _first_token(client: openai.OpenAI, **fields: Any) -> str:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        max_tokens=3,
        temperature=0,
        **fields,
    )
    assert answer.choices[0].logprobs and answer.choices[0].logprobs.content
    return str(answer.choices[0].logprobs.content[0].token)


def test_logit_bias_bans_a_token(client: openai.OpenAI) -> None:
    favourite = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=1,
        max_tokens=1,
        temperature=0,
    )
    assert favourite.choices[0].logprobs and favourite.choices[0].logprobs.content
    token = favourite.choices[0].logprobs.content[0]
    token_id = getattr(token, "id", None) or token.model_extra.get("id")  # type: ignore[union-attr]
    assert isinstance(token_id, int)
    assert _first_token(client, logit_bias={str(token_id): -100}) != token.token


def test_penalties_seed_and_stop_take_effect(client: openai.OpenAI) -> None:
    prompt: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "List the days of the week, again and again."}
    ]

    def text(**fields: Any) -> str:
        answer = client.chat.completions.create(
            model=CHAT_MODEL, messages=prompt, max_tokens=48, **fields
        )
        return answer.choices[0].message.content or ""

    plain = text(temperature=0)
    assert text(temperature=1.5, top_p=0.001) == plain  # only the likeliest token is left
    assert text(temperature=0, frequency_penalty=2.0) != plain
    assert text(temperature=0, presence_penalty=2.0) != plain
    assert text(temperature=1.5, seed=7) == text(temperature=1.5, seed=7)
    cut = plain.split()[2]
    stopped = text(temperature=0, stop=[cut])
    assert cut not in stopped and plain.startswith(stopped.rstrip())


def test_legacy_completions_streamed_and_not(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=CHAT_MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2
    )
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    choice = answer.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 8
    assert choice.logprobs is not None and "".join(choice.logprobs.tokens or []) == choice.text
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs or [])
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=CHAT_MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == choice.text


def test_a_batch_of_embeddings(client: openai.OpenAI, embedding_length: int) -> None:
    inputs = ["the cat sat on the mat", "the cat sat on the mat", "stock prices fell sharply"]
    answer = client.embeddings.create(model=EMBED_MODEL, input=inputs, encoding_format="float")
    assert [item.index for item in answer.data] == [0, 1, 2]
    vectors = [item.embedding for item in answer.data]
    assert all(len(v) == embedding_length for v in vectors)
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert answer.usage.prompt_tokens > 0 and answer.model == EMBED_MODEL
    raw = httpx.post(
        f"{client.base_url}embeddings",
        headers={"Authorization": f"Bearer {client.api_key}"},
        json={"model": EMBED_MODEL, "input": inputs[0], "encoding_format": "base64"},
        timeout=60,
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
    assert decoded == pytest.approx(vectors[0], abs=1e-6)


def test_a_model_answers_only_its_own_endpoints(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(
            model=EMBED_MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
    assert chat.value.code == "model_not_supported"
    with pytest.raises(openai.NotFoundError) as embed:
        client.embeddings.create(model=CHAT_MODEL, input="hi")
    assert embed.value.code == "model_not_supported"


def test_models_list_retrieve_and_mark_availability(client: openai.OpenAI) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards[CHAT_MODEL]["kind"] == "chat" and cards[CHAT_MODEL]["available"] is True
    assert cards[EMBED_MODEL]["kind"] == "embedding" and cards[EMBED_MODEL]["available"] is True
    assert client.models.retrieve(EMBED_MODEL).id == EMBED_MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_user_and_metadata_are_recorded_with_the_job(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        user="user-42",
        safety_identifier="hashed-user-42",
        metadata={"team": "search"},
        store=False,
    )
    job_id = answer.id.removeprefix("chatcmpl-")
    job = httpx.get(
        f"{cluster.url}/api/admin/jobs/{job_id[:8]}-{job_id[8:12]}-{job_id[12:16]}-"
        f"{job_id[16:20]}-{job_id[20:]}",
        headers={"Authorization": f"Bearer {cluster.admin_api_key}"},
        timeout=10,
    ).json()
    assert job["params"]["user"] == "user-42"
    assert job["params"]["safety_identifier"] == "hashed-user-42"
    assert job["params"]["metadata"] == {"team": "search"}


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"{c['endpoint']}-{c['param']}")
def test_fields_we_cannot_honour_are_refused_by_name(
    client: openai.OpenAI, case: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        if case["endpoint"] == "chat":
            body: dict[str, Any] = {
                "model": CHAT_MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                **case["body"],
            }
            client.post("/chat/completions", body=body, cast_to=httpx.Response)
        elif case["endpoint"] == "completions":
            body = {"model": CHAT_MODEL, "prompt": "Hi", **case["body"]}
            client.post("/completions", body=body, cast_to=httpx.Response)
        else:
            body = {"model": EMBED_MODEL, "input": "Hi", **case["body"]}
            client.post("/embeddings", body=body, cast_to=httpx.Response)
    assert refused.value.param == case["param"]
