"""Checks shared by the OpenAI endpoints' request validation: numbers, flags, the sampling
fields every generation endpoint takes, and the fields we cannot honour.

Every problem is an :class:`ApiError` 400 in OpenAI's shape naming the ``param``. A field we
cannot honour is refused by name (``unsupported_parameter``), never dropped; an unknown field
is refused as OpenAI refuses it (``unknown_parameter``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from application.commands import Caller
from interfaces.http.http_errors import ApiError, ErrorCode

MAX_STOP = 4
#: The largest ``max_tokens`` accepted (a context no model here reaches).
MAX_CONTEXT = 1 << 20
#: ``seed`` travels to the node as a protobuf int64.
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 63) - 1
#: OpenAI's limits on ``logit_bias``, ``user`` and ``metadata``.
MAX_LOGIT_BIAS = 300
MAX_USER_CHARS = 256
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: The code of a 400 for fields that disagree (see :func:`mismatch`).
INVALID_COMBINATION = ErrorCode.INVALID_COMBINATION


def bad(message: str, param: str, code: ErrorCode = ErrorCode.INVALID_VALUE) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def mismatch(message: str, param: str) -> ApiError:
    """Two fields that must agree in a way JSON Schema cannot say (the OpenAPI schema allows
    each alone): ``invalid_combination``."""
    return bad(message, param, INVALID_COMBINATION)


def unsupported(param: str, why: str) -> ApiError:
    return bad(f"{param} is not supported: {why}", param, ErrorCode.UNSUPPORTED_PARAMETER)


def refuse_unknown(body: Mapping[str, Any], known: Iterable[str]) -> None:
    """OpenAI answers a field it does not know with 400; so do we."""
    extra = sorted(set(body) - set(known))
    if extra:
        raise bad(
            f"Unrecognized request argument supplied: {extra[0]}",
            extra[0],
            ErrorCode.UNKNOWN_PARAMETER,
        )


def number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{key} must be a number", key)
    if not low <= value <= high:
        raise bad(f"{value} is out of range for {key}: expected {low} to {high}", key)
    return float(value)


def integer(body: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    """``body[key]`` as an int in ``low..high`` (``None`` when absent or null). JSON's ``2.0``
    is the integer 2, as JSON Schema's ``integer`` says; ``2.5`` and ``true`` are not."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer", key)
    if not low <= value <= high:
        raise bad(f"{key} must be between {low} and {high}", key)
    return value


def flag(body: Mapping[str, Any], key: str, param: str | None = None) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{param or key} must be a boolean", param or key)
    return value


def one_choice(body: Mapping[str, Any]) -> None:
    """``n`` (and ``best_of``) above 1 are refused: one choice per request."""
    for key in ("n", "best_of"):
        if key in body and integer(body, key, 1, 128) not in (None, 1):
            raise unsupported(key, "one choice per request; send several requests instead")


def stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    for key in options:
        if key != "include_usage":
            raise unsupported(f"stream_options.{key}", "only include_usage is")
    return stream, bool(flag(options, "include_usage", "stream_options.include_usage"))


def stop_list(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise bad(f"stop must be a string or up to {MAX_STOP} non-empty strings", "stop")
    return stop or []


def sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields both generation endpoints forward to llama-server as they are:
    OpenAI's penalties and ``logit_bias``, and llama.cpp's ``top_k``, ``min_p`` and
    ``repeat_penalty`` (which llama-server users send through OpenAI SDKs as extra fields)."""
    options: dict[str, Any] = {}
    for key in ("presence_penalty", "frequency_penalty"):
        if (value := number(body, key, -2.0, 2.0)) is not None:
            options[key] = value
    if (top_k := integer(body, "top_k", 0, 1 << 20)) is not None:
        options["top_k"] = top_k
    if (min_p := number(body, "min_p", 0.0, 1.0)) is not None:
        options["min_p"] = min_p
    if (repeat := number(body, "repeat_penalty", 0.0, 10.0)) is not None:
        options["repeat_penalty"] = repeat
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise bad(
                f"logit_bias must map up to {MAX_LOGIT_BIAS} token ids to numbers", "logit_bias"
            )
        for token, value in bias.items():
            if not token.isdigit():
                raise bad(f"logit_bias keys are token ids, got {token!r}", "logit_bias")
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not -100 <= value <= 100
            ):
                raise bad("logit_bias values must be numbers from -100 to 100", "logit_bias")
        # llama-server takes OpenAI's object form.
        options["logit_bias"] = {token: float(value) for token, value in bias.items()}
    return options


def _caller_text(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_USER_CHARS:
        raise bad(f"{key} must be a string of at most {MAX_USER_CHARS} characters", key)
    return value


def caller(body: Mapping[str, Any]) -> Caller:
    """``user``, ``safety_identifier`` and ``metadata``: recorded with the job (the admin jobs
    API shows them), never sent to the model."""
    user = _caller_text(body, "user")
    safety_identifier = _caller_text(body, "safety_identifier")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS:
            raise bad(f"metadata must be an object of at most {MAX_METADATA_KEYS} keys", "metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str):
                raise bad(
                    f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters and "
                    "values are strings",
                    "metadata",
                )
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise bad(
                    f"metadata values have at most {MAX_METADATA_VALUE_CHARS} characters",
                    "metadata",
                )
    return Caller(user, safety_identifier, metadata)


def model_name(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(
            400,
            "you must provide a model parameter",
            param="model",
            code=ErrorCode.MISSING_REQUIRED_PARAMETER,
        )
    return model


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code=ErrorCode.INVALID_JSON)
    return body
