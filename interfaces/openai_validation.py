"""Validation of OpenAI chat-completion requests into a :class:`Submission`.

Every problem becomes a 400 in OpenAI's error shape naming the offending ``param``.
"""

from __future__ import annotations

import math
from typing import Any

from application.commands import Submission
from interfaces.http_errors import ApiError

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP = 4


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _text_content(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _bad("only text content parts are supported", f"messages[{index}].content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise _bad("content must be a string or a list of text parts", f"messages[{index}].content")


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{key} must be a number", key)
    if not low <= value <= high:
        raise _bad(f"{value} is out of range for {key}: expected {low} to {high}", key)
    return float(value)


def parse_chat_request(body: Any, max_context: int = 1 << 20) -> Submission:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(
            400,
            "you must provide a model parameter",
            param="model",
            code="missing_required_parameter",
        )
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ApiError(
            400,
            "messages must be a non-empty array",
            param="messages",
            code="missing_required_parameter" if raw_messages is None else "invalid_value",
        )
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(raw_messages):
        if not isinstance(m, dict):
            raise _bad("each message must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"role must be one of {sorted(ROLES)}", f"messages[{i}].role")
        messages.append({"role": role, "content": _text_content(m.get("content"), i)})
    n = body.get("n", 1)
    if n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise _bad("max_tokens must be an integer", "max_tokens")
        if not 1 <= max_tokens <= max_context:
            raise _bad(f"max_tokens must be between 1 and {max_context}", "max_tokens")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _bad(f"stop must be a string or up to {MAX_STOP} non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("seed must be an integer", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": stop or [],
        "seed": seed,
        "include_usage": include_usage,
    }
    return Submission(model=model, messages=messages, params=params, stream=stream)
