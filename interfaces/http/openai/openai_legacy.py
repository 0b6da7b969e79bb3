"""Validation of ``/v1/completions`` (legacy completions) and ``/v1/embeddings`` requests into
a :class:`Submission`, field by field from the pinned Python SDK's params, like the chat
endpoint (:mod:`interfaces.http.openai.openai_validation`)."""

from __future__ import annotations

from typing import Any

from application.commands import EmbeddingInputs, JobParams, Prompt, Submission, TextPrompt
from interfaces.http.http_errors import ErrorCode
from interfaces.http.openai.openai_fields import (
    MAX_CONTEXT,
    SEED_MAX,
    SEED_MIN,
    bad,
    caller,
    flag,
    integer,
    json_object,
    model_name,
    number,
    one_choice,
    refuse_unknown,
    sampling,
    stop_list,
    stream_flags,
    unsupported,
)

#: OpenAI's default ``max_tokens`` for a legacy completion.
DEFAULT_COMPLETION_TOKENS = 16
MAX_COMPLETION_LOGPROBS = 5
#: OpenAI's limits on one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
ENCODINGS = ("float", "base64")
#: Token ids are 32-bit in llama.cpp.
MAX_TOKEN_ID = (1 << 31) - 1

COMPLETION_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "best_of",
        "echo",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "suffix",
        "temperature",
        "top_p",
        "user",
        "top_k",
        "min_p",
        "repeat_penalty",
    }
)
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


def _token(value: Any) -> int | None:
    """A token id (JSON's ``5.0`` is the integer 5, as JSON Schema says), or None."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID:
        return value
    return None


def _tokens(value: Any) -> list[int] | None:
    """A non-empty list of token ids, or None."""
    if not isinstance(value, list) or not value:
        return None
    tokens: list[int] = []
    for item in value:
        token = _token(item)
        if token is None:
            return None
        tokens.append(token)
    return tokens


def _prompt(body: dict[str, Any]) -> str | list[int]:
    """One prompt: a string or a list of token ids (a one-element batch of either)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("you must provide a prompt", "prompt", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise unsupported("prompt", "one prompt per request; send several requests instead")
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (tokens := _tokens(prompt)) is not None:
        return tokens
    raise bad("prompt must be a non-empty string or list of token ids", "prompt")


def parse_completion_request(body: Any, max_context: int = MAX_CONTEXT) -> Submission:
    body = json_object(body)
    model = model_name(body)
    refuse_unknown(body, COMPLETION_FIELDS)
    prompt = _prompt(body)
    one_choice(body)
    if flag(body, "echo"):
        raise unsupported("echo", "the answer does not repeat the prompt")
    if body.get("suffix") is not None:
        raise unsupported("suffix", "llama-server completes after the prompt only")
    stream, include_usage = stream_flags(body)
    options: dict[str, Any] = sampling(body)
    logprobs = integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if logprobs is not None:
        # llama-server's completions take the count itself, and send nothing for 0.
        options["logprobs"] = max(logprobs, 1)
    max_tokens = integer(body, "max_tokens", 1, max_context)
    params = JobParams(
        max_tokens=DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0),
        top_p=number(body, "top_p", 0.0, 1.0),
        stop=stop_list(body),
        seed=integer(body, "seed", SEED_MIN, SEED_MAX),
        include_usage=include_usage,
        top_logprobs=logprobs,
        caller=caller(body),
        options=options,
    )
    # The prompt is the job's content (recorded as RECORD_CONTENT says), not a parameter.
    return Submission(model, TextPrompt(prompt), params, stream)


def _inputs(body: dict[str, Any]) -> list[str] | list[list[int]]:
    value = body.get("input")
    if value is None:
        raise bad("you must provide an input", "input", ErrorCode.MISSING_REQUIRED_PARAMETER)
    if isinstance(value, str) or _tokens(value) is not None:
        value = [value]
    if not isinstance(value, list) or not value or len(value) > MAX_EMBEDDING_INPUTS:
        raise bad(f"input must hold 1 to {MAX_EMBEDDING_INPUTS} items", "input")
    texts = [item for item in value if isinstance(item, str) and item]
    if len(texts) == len(value):
        return texts
    batches = [_tokens(item) for item in value]
    if all(tokens is not None for tokens in batches):
        return [tokens for tokens in batches if tokens is not None]
    raise bad("input is a non-empty string, a list of them, or token id lists", "input")


def parse_embeddings_request(body: Any) -> tuple[Submission, str]:
    """The job, and the ``encoding_format`` its vectors are answered in."""
    body = json_object(body)
    model = model_name(body)
    refuse_unknown(body, EMBEDDING_FIELDS)
    inputs = _inputs(body)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad('encoding_format is "float" or "base64"', "encoding_format")
    if body.get("dimensions") is not None:
        raise unsupported("dimensions", "vectors have the model's own embedding length")
    params = JobParams(caller=caller(body))
    return Submission(model, EmbeddingInputs(inputs), params, stream=False), encoding


def prompt_of(submission: Submission) -> Prompt | None:
    """What the controller counts of a submission before a node sees it (None: embeddings,
    whose inputs the node's server bounds by its batch size)."""
    prompt = submission.prompt
    return None if isinstance(prompt, EmbeddingInputs) else prompt
