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
#: The largest ``max_tokens`` accepted (a context no model here reaches).
MAX_CONTEXT = 1 << 20
#: ``seed`` travels to the node as a protobuf int64.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1


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
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad("a text part's text must be a string", f"messages[{index}].content")
            parts.append(text)
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


def _integer(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    """``body[key]`` as an int in ``low..high`` (``None`` when absent or null). JSON's ``2.0``
    is the integer 2, as JSON Schema's ``integer`` says; ``2.5`` and ``true`` are not."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{key} must be an integer", key)
    if not low <= value <= high:
        raise _bad(f"{key} must be between {low} and {high}", key)
    return value


def _flag(body: dict[str, Any], key: str, param: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{param} must be a boolean", param)
    return bool(value)


def parse_chat_request(body: Any, max_context: int = MAX_CONTEXT) -> Submission:
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
    if isinstance(n, bool) or n not in (None, 1):
        raise _bad("only n=1 is supported", "n")
    # Both are checked; the newer name wins when both are given.
    legacy = _integer(body, "max_tokens", 1, max_context)
    max_tokens = _integer(body, "max_completion_tokens", 1, max_context)
    if max_tokens is None:
        max_tokens = legacy
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
    seed = _integer(body, "seed", SEED_MIN, SEED_MAX)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": stop or [],
        "seed": seed,
        "include_usage": include_usage,
    }
    return Submission(model=model, messages=messages, params=params, stream=stream)
