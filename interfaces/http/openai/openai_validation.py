"""Validation of OpenAI chat-completion requests into a :class:`Submission`.

Every field of the pinned Python SDK's ``CompletionCreateParams`` is either honoured (forwarded
to llama-server with the same meaning, or acted on here) or refused with a 400 naming it; see
:data:`CHAT_FIELDS` and :data:`CHAT_REFUSED`. Unknown fields are refused too.
"""

from __future__ import annotations

import re
from typing import Any

from application.commands import ChatPrompt, JobParams, Submission
from interfaces.http.http_errors import ApiError, ErrorCode
from interfaces.http.openai import openai_tools
from interfaces.http.openai.openai_fields import (
    MAX_CONTEXT,
    SEED_MAX,
    SEED_MIN,
    bad,
    caller,
    flag,
    integer,
    json_object,
    mismatch,
    model_name,
    number,
    one_choice,
    refuse_unknown,
    sampling,
    stop_list,
    stream_flags,
    unsupported,
)

__all__ = ["CHAT_FIELDS", "CHAT_REFUSED", "SEED_MAX", "SEED_MIN", "parse_chat_request"]

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The fields a history message may have, by role (the SDKs echo back an assistant message's
#: ``refusal``, ``audio`` and ``function_call``; they must be null, or a refusal's text).
MESSAGE_FIELDS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset(
        {"role", "content", "name", "tool_calls", "refusal", "audio", "function_call"}
    ),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}


def _keys(value: dict[str, Any], allowed: set[str] | frozenset[str], param: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise bad(f"unknown field {extra[0]!r}", f"{param}.{extra[0]}", ErrorCode.UNKNOWN_PARAMETER)


#: Fields we cannot honour, and why (a non-null value is a 400 naming the field).
CHAT_REFUSED: dict[str, str] = {
    "audio": "audio output needs an audio model",
    "prediction": "predicted outputs are not implemented by llama-server",
    "web_search_options": "there is no web search",
    "reasoning_effort": "the model's chat template decides how it reasons",
    "verbosity": "the model decides how much it writes",
    "functions": "use tools",
    "function_call": "use tool_choice",
    "prompt_cache_key": "llama-server caches prompts by their tokens, per slot",
    "prompt_cache_options": "llama-server caches prompts by their tokens, per slot",
    "prompt_cache_retention": "llama-server caches prompts by their tokens, per slot",
    "moderation": "there is no moderation model",
    "service_tier": "there is one tier",
}
#: Every field this endpoint knows (the SDK's, and llama.cpp's sampling extras).
CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "n",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
        "safety_identifier",
        "metadata",
        "modalities",
        "store",
        "top_k",
        "min_p",
        "repeat_penalty",
        *CHAT_REFUSED,
    }
)


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise unsupported(param, "only text content parts are")
            _keys(part, {"type", "text"}, param)
            text = part.get("text")
            if not isinstance(text, str):
                raise bad("a text part's text must be a string", param)
            parts.append(text)
        return "".join(parts)
    raise bad("content must be a string or a list of text parts", param)


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise bad("tool_calls must be a non-empty array", param)
    out = []
    for i, call in enumerate(calls):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(call, dict) and isinstance(function, dict):
            _keys(call, {"id", "type", "function"}, where)
            _keys(function, {"name", "arguments"}, f"{where}.function")
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise bad(
                "a tool call is {id, type: function, function: {name, arguments: string}}", where
            )
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return out


def _message(m: Any, i: int) -> dict[str, Any]:
    """One history message, as llama-server's chat templates take it."""
    if not isinstance(m, dict):
        raise bad("each message must be an object", f"messages[{i}]")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"role must be one of {sorted(ROLES)}", f"messages[{i}].role")
    _keys(m, MESSAGE_FIELDS[role], f"messages[{i}]")
    for echoed in ("audio", "function_call"):
        if m.get(echoed) is not None:
            raise unsupported(f"messages[{i}].{echoed}", "only null is accepted")
    if m.get("refusal") is not None and not isinstance(m["refusal"], str):
        raise bad("refusal must be a string", f"messages[{i}].refusal")
    out: dict[str, Any] = {"role": role}
    content = m.get("content")
    if role == "assistant" and m.get("tool_calls") is not None:
        out["content"] = None if content is None else _text(content, f"messages[{i}].content")
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
    else:
        out["content"] = "" if content is None else _text(content, f"messages[{i}].content")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise bad("a tool message needs its tool_call_id", f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad("name must be a string", f"messages[{i}].name")
        out["name"] = name
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"tools must be an array of at most {MAX_TOOLS} functions", "tools")
    seen = set()
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise unsupported(f"tools[{i}].type", "only function tools are")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad("a tool is {type: function, function: {name, ...}}", f"tools[{i}]")
        _keys(tool, {"type", "function"}, f"tools[{i}]")
        _keys(function, {"name", "description", "parameters", "strict"}, f"tools[{i}].function")
        name = function["name"]
        if not _FUNCTION_NAME.fullmatch(name):
            raise bad("function names are 1-64 of a-z A-Z 0-9 _ -", f"tools[{i}]")
        if name in seen:
            raise mismatch(f"two tools are named {name!r}", f"tools[{i}]")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad("parameters must be a JSON schema object", f"tools[{i}].function")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad("description must be a string", f"tools[{i}].function")
        flag(function, "strict", f"tools[{i}].function.strict")
        clean: dict[str, Any] = {"name": name}
        if description is not None:
            clean["description"] = description
        if parameters is not None:
            clean["parameters"] = parameters
        out.append({"type": "function", "function": clean})
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> Any:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    shape = 'tool_choice is "none", "auto", "required" or {type: function, function: {name}}'
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            raise bad(shape, "tool_choice")
        _keys(choice, {"type", "function"}, "tool_choice")
        _keys(function, {"name"}, "tool_choice.function")
        name = function.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad(shape, "tool_choice")
        if not _FUNCTION_NAME.fullmatch(name):
            raise bad("function names are 1-64 of a-z A-Z 0-9 _ -", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise bad(shape, "tool_choice")
    if not tools:
        raise mismatch("tool_choice is only allowed when tools are specified", "tool_choice")
    if not isinstance(choice, dict):
        return choice
    if name not in {tool["function"]["name"] for tool in tools}:
        raise mismatch(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        _keys(value, {"type"}, "response_format")
        return None if kind == "text" else {"type": "json_object"}
    if kind == "json_schema":
        _keys(value, {"type", "json_schema"}, "response_format")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad("json_schema needs a name (and a schema)", "response_format.json_schema")
        _keys(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad("json_schema.schema must be an object", "response_format.json_schema")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise bad("description must be a string", "response_format.json_schema")
        flag(spec, "strict", "response_format.json_schema.strict")
        return {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": schema}}
    raise bad('response_format.type is "text", "json_object" or "json_schema"', "response_format")


def _refusals(body: dict[str, Any]) -> None:
    for key, why in CHAT_REFUSED.items():
        if body.get(key) is not None:
            raise unsupported(key, why)
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or modalities != ["text"]):
        raise unsupported("modalities", 'text is the only output ("modalities": ["text"])')
    if flag(body, "store"):
        raise unsupported("store", "completions are recorded as job events, not stored for evals")


def parse_chat_request(body: Any, max_context: int = MAX_CONTEXT) -> Submission:
    body = json_object(body)
    model = model_name(body)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ApiError(
            400,
            "messages must be a non-empty array",
            param="messages",
            code=(
                ErrorCode.MISSING_REQUIRED_PARAMETER
                if raw_messages is None
                else ErrorCode.INVALID_VALUE
            ),
        )
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    refuse_unknown(body, CHAT_FIELDS)
    _refusals(body)
    one_choice(body)
    # Both are checked; the newer name wins when both are given.
    legacy = integer(body, "max_tokens", 1, max_context)
    max_tokens = integer(body, "max_completion_tokens", 1, max_context)
    if max_tokens is None:
        max_tokens = legacy
    stream, include_usage = stream_flags(body)
    options = sampling(body)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    response_format = _response_format(body)
    parallel = flag(body, "parallel_tool_calls")
    logprobs = flag(body, "logprobs")
    top_logprobs = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise mismatch("top_logprobs needs logprobs: true", "top_logprobs")
    if logprobs:
        # llama-server sends no logprobs for top_logprobs 0 (and 20 alternatives when it is
        # absent): it is asked for at least one, and the answer keeps as many as asked.
        options["logprobs"] = True
        options["top_logprobs"] = max(top_logprobs or 0, 1)
    forced = openai_tools.forced_names(tools, choice)
    offered: list[dict[str, Any]] = []
    if forced is not None:
        if response_format is not None:
            raise mismatch("a forced tool call is the answer's format", "response_format")
        messages, response_format = openai_tools.force(messages, tools, forced)
    elif tools:
        offered = tools
        if choice is not None:
            options["tool_choice"] = choice
        if parallel is not None:
            options["parallel_tool_calls"] = parallel
    if response_format is not None:
        options["response_format"] = response_format
    params = JobParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0),
        stop=stop_list(body),
        seed=integer(body, "seed", SEED_MIN, SEED_MAX),
        include_usage=include_usage,
        top_logprobs=(top_logprobs or 0) if logprobs else None,
        forced_tools=forced,
        caller=caller(body),
        options=options,
    )
    return Submission(model, ChatPrompt(messages, offered), params, stream)
