"""The OpenAI surface without a cluster: every field of the pinned SDK's request params is
known (honoured or refused by name), what is honoured reaches llama-server's request, forced
tool calls round-trip through their grammar's JSON, and answers are assembled from deltas and
their extras as OpenAI shapes them. The same behaviour against real llama.cpp is
tests/conformance."""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
import pytest
from openai.types import Completion, completion_create_params, embedding_create_params
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat import completion_create_params as chat_params

from agent.runtime import llama_server
from agent.runtime.llama_server import ChatDelta, ChatRequest
from application.commands import (
    Caller,
    ChatPrompt,
    Delta,
    EmbeddingInputs,
    JobOutcome,
    TextPrompt,
)
from common.contract import Endpoint
from interfaces.http.http_errors import ApiError
from interfaces.http.openai import openai_tools
from interfaces.http.openai.openai_docs import CHAT_REQUEST, COMPLETION_REQUEST, EMBEDDINGS_REQUEST
from interfaces.http.openai.openai_fields import INVALID_COMBINATION
from interfaces.http.openai.openai_legacy import (
    COMPLETION_FIELDS,
    EMBEDDING_FIELDS,
    parse_completion_request,
    parse_embeddings_request,
)
from interfaces.http.openai.openai_responses import (
    Answer,
    ChatStream,
    Collected,
    CompletionStream,
    chat_message,
    completion,
    embeddings,
)
from interfaces.http.openai.openai_validation import CHAT_FIELDS, CHAT_REFUSED, parse_chat_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
OUTCOME = JobOutcome("stop", 3, 2, 10.0, 50.0)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(parse: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value


# --- every field is known -------------------------------------------------------------------


def test_every_sdk_field_is_known_and_documented() -> None:
    assert set(chat_params.CompletionCreateParamsBase.__annotations__) <= CHAT_FIELDS
    assert set(completion_create_params.CompletionCreateParamsBase.__annotations__) <= (
        COMPLETION_FIELDS
    )
    assert set(embedding_create_params.EmbeddingCreateParams.__annotations__) <= (EMBEDDING_FIELDS)
    assert set(CHAT_REQUEST.properties or {}) == CHAT_FIELDS
    assert set(COMPLETION_REQUEST.properties or {}) == COMPLETION_FIELDS
    assert set(EMBEDDINGS_REQUEST.properties or {}) == EMBEDDING_FIELDS


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_a_field_we_cannot_honour_is_refused_by_name(field: str) -> None:
    error = refused(parse_chat_request, chat(**{field: "x"}))
    assert (error.param, error.code) == (field, "unsupported_parameter")
    parse_chat_request(chat(**{field: None}))  # null is absent


def test_an_unknown_field_is_refused_as_openai_does() -> None:
    error = refused(parse_chat_request, chat(top_a=1))
    assert (error.param, error.code) == ("top_a", "unknown_parameter")


# --- what is honoured reaches llama-server --------------------------------------------------


def test_sampling_fields_are_forwarded_with_their_meaning() -> None:
    submission = parse_chat_request(
        chat(
            presence_penalty=0.5,
            frequency_penalty=-1,
            logit_bias={"42": -100, "7": 3},
            top_k=20,
            min_p=0.05,
            repeat_penalty=1.1,
            seed=3,
            stop="END",
            user="u",
            metadata={"k": "v"},
            modalities=["text"],
            store=False,
        )
    )
    assert submission.params.options == {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "logit_bias": {"42": -100.0, "7": 3.0},
        "top_k": 20,
        "min_p": 0.05,
        "repeat_penalty": 1.1,
    }
    assert submission.params.seed == 3 and submission.params.stop == ["END"]
    assert submission.params.caller == Caller(user="u", metadata={"k": "v"})
    assert isinstance(submission.prompt, ChatPrompt)
    payload = ChatRequest(submission.prompt.messages, options=submission.params.options).payload()
    assert payload["logit_bias"] == {"42": -100.0, "7": 3.0} and payload["stream"] is True


def test_logprobs_ask_llama_server_for_at_least_one_alternative() -> None:
    options = parse_chat_request(chat(logprobs=True))
    assert options.params.options["top_logprobs"] == 1 and options.params.top_logprobs == 0
    three = parse_chat_request(chat(logprobs=True, top_logprobs=3))
    assert three.params.options["top_logprobs"] == 3 and three.params.top_logprobs == 3
    error = refused(parse_chat_request, chat(top_logprobs=2))
    assert (error.param, error.code) == ("top_logprobs", INVALID_COMBINATION)


def test_the_tool_history_is_kept_whole() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]},
    ]
    submission = parse_chat_request(chat(messages=messages))
    assert submission.prompt == ChatPrompt(
        [
            {"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
        ]
    )
    error = refused(parse_chat_request, chat(messages=[{"role": "tool", "content": "x"}]))
    assert error.param == "messages[0].tool_call_id"


def test_auto_tools_go_to_the_template_and_forced_ones_to_a_grammar() -> None:
    auto = parse_chat_request(chat(tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False))
    assert isinstance(auto.prompt, ChatPrompt) and auto.prompt.tools == [WEATHER]
    assert auto.recorded_params()["options"]["tools"] == [WEATHER]
    assert auto.params.options["parallel_tool_calls"] is False
    assert auto.params.forced_tools is None
    forced = parse_chat_request(chat(tools=[WEATHER], tool_choice="required"))
    assert isinstance(forced.prompt, ChatPrompt) and forced.prompt.tools == []
    assert "tools" not in forced.params.options and forced.params.forced_tools == ["get_weather"]
    schema = forced.params.options["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["name"] == {"const": "get_weather"}
    first = forced.prompt.messages[0]
    assert first["role"] == "system" and "get_weather" in first["content"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
    ],
)
def test_fields_that_disagree_are_an_invalid_combination(
    fields: dict[str, Any], param: str
) -> None:
    error = refused(parse_chat_request, chat(**fields))
    assert (error.param, error.code) == (param, INVALID_COMBINATION)


def test_legacy_completions_and_embeddings_requests() -> None:
    submission = parse_completion_request({"model": "m", "prompt": ["Once"], "logprobs": 0})
    assert submission.prompt == TextPrompt("Once") and submission.endpoint == Endpoint.COMPLETIONS
    assert submission.recorded_messages() == [{"role": "prompt", "content": "Once"}]
    assert submission.recorded_params()["endpoint"] == "completions"
    assert submission.params.max_tokens == 16  # OpenAI's default
    assert submission.params.options["logprobs"] == 1 and submission.params.top_logprobs == 0
    tokens = parse_completion_request({"model": "m", "prompt": [1, 2.0]})
    assert tokens.prompt == TextPrompt([1, 2])
    assert (
        refused(parse_completion_request, {"model": "m", "prompt": "x", "echo": True}).param
        == "echo"
    )
    batch, encoding = parse_embeddings_request(
        {"model": "e", "input": ["a", "b"], "encoding_format": "base64"}
    )
    assert batch.prompt == EmbeddingInputs(["a", "b"]) and encoding == "base64"
    assert batch.endpoint == Endpoint.EMBEDDINGS
    assert [m["content"] for m in batch.recorded_messages()] == ["a", "b"]
    assert batch.recorded_params() == {"endpoint": "embeddings"}
    refusal = refused(parse_embeddings_request, {"model": "e", "input": "a", "dimensions": 8})
    assert (refusal.param, refusal.code) == ("dimensions", "unsupported_parameter")


# --- forced tool calls ---------------------------------------------------------------------


def test_a_forced_call_is_parsed_and_streamed_in_fragments() -> None:
    calls = openai_tools.tool_calls_of(
        '{"name": "get_weather", "arguments": {"city": "Paris"}}', ["get_weather"]
    )
    assert calls is not None and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    assert openai_tools.tool_calls_of('{"name": "get_weather", "argu', ["get_weather"]) is None
    assert openai_tools.tool_calls_of('{"name": "rm", "arguments": {}}', ["get_weather"]) is None
    fragments = openai_tools.streamed(calls)
    assert fragments[0]["id"] == calls[0]["id"] and fragments[0]["function"]["arguments"] == ""
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city":"Paris"}'
    both = openai_tools.call_schema(
        [WEATHER, {**WEATHER, "function": {"name": "g"}}], ["get_weather", "g"]
    )
    assert len(both["anyOf"]) == 2


# --- answers from deltas and their extras ---------------------------------------------------


def extra(delta: dict[str, Any] | None = None, logprobs: Any = None) -> str:
    return orjson.dumps({"delta": delta or {}, "logprobs": logprobs}).decode()


def entry(token: str, alternatives: int) -> dict[str, Any]:
    top = [{"token": token, "logprob": -0.1, "bytes": None}] * alternatives
    return {"token": token, "logprob": -0.1, "bytes": None, "top_logprobs": top}


def test_tool_call_fragments_reasoning_and_logprobs_are_collected() -> None:
    collected = Collected(top=1)
    collected.add(
        [
            Delta(
                0,
                "",
                extra=extra({"reasoning_content": "Think"}),
            ),
            Delta(
                1,
                "",
                extra=extra(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"a"'},
                            }
                        ]
                    }
                ),
            ),
            Delta(
                2,
                "",
                extra=extra({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
            ),
            Delta(3, "Hi", extra=extra(logprobs={"content": [entry("Hi", 3)]})),
        ]
    )
    answer = chat_message(Answer("chatcmpl-x", 1, "m"), collected, OUTCOME)
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "Think" and message["content"] == "Hi"
    assert message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]
    logprobs = answer["choices"][0]["logprobs"]["content"]
    assert len(logprobs) == 1 and len(logprobs[0]["top_logprobs"]) == 1  # as many as asked


def test_streamed_extras_become_their_own_chunks() -> None:
    stream = ChatStream(Answer("chatcmpl-x", 1, "m", top_logprobs=0))
    plain = list(stream.deltas([Delta(0, "a"), Delta(1, "b")]))
    assert len(plain) == 1 and orjson.loads(plain[0][6:])["choices"][0]["delta"] == {
        "content": "ab"
    }
    rich = list(stream.deltas([Delta(2, "c", extra=extra(logprobs={"content": [entry("c", 1)]}))]))
    choice = orjson.loads(rich[0][6:])["choices"][0]
    assert choice["delta"] == {"content": "c"}
    assert choice["logprobs"]["content"][0]["top_logprobs"] == []


def test_cached_prompt_tokens_are_in_the_usage_as_openai_gives_them() -> None:
    """Non-streamed and streamed, chat and legacy: the SDK's own models read them back."""
    outcome = JobOutcome("stop", 1600, 8, 10.0, 50.0, cached_prompt_tokens=1536)
    chat_answer = Answer("chatcmpl-x", 1, "m", include_usage=True)
    legacy_answer = Answer("cmpl-x", 1, "m", include_usage=True)
    whole: list[ChatCompletion | Completion] = [
        ChatCompletion.model_validate(chat_message(chat_answer, Collected(None), outcome)),
        Completion.model_validate(completion(legacy_answer, Collected(None), outcome)),
    ]
    chat_last = list(ChatStream(chat_answer).ending(None, outcome))[-1]
    legacy_last = list(CompletionStream(legacy_answer).ending(None, outcome))[-1]
    usages = [
        *(answer.usage for answer in whole),
        ChatCompletionChunk.model_validate(orjson.loads(chat_last[6:])).usage,
        Completion.model_validate(orjson.loads(legacy_last[6:])).usage,
    ]
    for usage in usages:
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (1600, 1536)
    uncached = chat_message(chat_answer, Collected(None), OUTCOME)["usage"]
    assert uncached["prompt_tokens_details"] == {"cached_tokens": 0}


def test_legacy_completion_logprobs_and_base64_embeddings() -> None:
    collected = Collected(top=1)
    collected.add([Delta(0, "Hi", extra=extra(logprobs={"content": [entry("Hi", 2)]}))])
    answer = completion(Answer("cmpl-x", 1, "m", top_logprobs=1), collected, OUTCOME)
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": ["Hi"],
        "token_logprobs": [-0.1],
        "top_logprobs": [{"Hi": -0.1}],
        "text_offset": [0],
    }
    vectors = [{"index": 1, "embedding": [0.5, -1.0]}, {"index": 0, "embedding": [0.25, 2.0]}]
    outcome = JobOutcome("stop", 4, 0, 1.0, 0.0, output=orjson.dumps(vectors).decode())
    floats = embeddings("e", outcome, "float")
    assert [d["embedding"] for d in floats["data"]] == [[0.25, 2.0], [0.5, -1.0]]
    packed = embeddings("e", outcome, "base64")["data"][0]["embedding"]
    assert struct.unpack("<2f", base64.b64decode(packed)) == (0.25, 2.0)
    assert floats["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


# --- the agent's side: llama-server's stream -----------------------------------------------


def test_the_agent_passes_on_what_comes_besides_content() -> None:
    call = {"index": 0, "function": {"arguments": "{"}}
    tool = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    parsed = llama_server._parse_sse_line(tool)
    assert isinstance(parsed, ChatDelta) and parsed.text == ""
    assert orjson.loads(parsed.extra)["delta"]["tool_calls"][0]["function"]["arguments"] == "{"
    logprobs = {"content": [{"token": "Hi"}]}
    choice = {"index": 0, "delta": {"content": "Hi"}, "logprobs": logprobs}
    text = b"data: " + orjson.dumps({"choices": [choice]})
    with_logprobs = llama_server._parse_sse_line(text)
    assert isinstance(with_logprobs, ChatDelta) and with_logprobs.text == "Hi"
    assert orjson.loads(with_logprobs.extra)["logprobs"]["content"][0]["token"] == "Hi"
    plain = llama_server._parse_sse_line(
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"x"}}]}'
    )
    assert plain == ChatDelta(text="x")  # no extras on the hot path
    legacy = llama_server._parse_sse_line(b'data: {"choices":[{"index":0,"text":" upon"}]}')
    assert legacy == ChatDelta(text=" upon")


def test_a_completion_request_sends_the_prompt_not_messages() -> None:
    request = ChatRequest([], prompt="Once", max_tokens=4)
    payload = request.payload()
    assert request.path == "/v1/completions"
    assert payload["prompt"] == "Once" and "messages" not in payload and payload["max_tokens"] == 4
