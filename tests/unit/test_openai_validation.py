"""``parse_chat_request``: what the chat API accepts is what its OpenAPI schema documents.

Regressions found by fuzzing the schema (tests/integration/test_api_fuzz.py): each of these
requests was answered differently from what the schema promised.
"""

from __future__ import annotations

from typing import Any

import pytest

from interfaces.http.http_errors import ApiError
from interfaces.http.openai.openai_validation import SEED_MAX, SEED_MIN, parse_chat_request


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(request: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat_request(request)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # JSON's true is not the number 1 (Python's True == 1 let it through).
        ({"n": True}, "n"),
        # Both spellings are checked: an invalid max_tokens was ignored whenever
        # max_completion_tokens was present, even as null.
        ({"max_completion_tokens": None, "max_tokens": -5}, "max_tokens"),
        ({"max_completion_tokens": 10, "max_tokens": "many"}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        # A flag is a boolean: "no" was taken as true.
        ({"stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
        # The seed travels to the node as an int64.
        ({"seed": SEED_MAX + 1}, "seed"),
        ({"seed": SEED_MIN - 1}, "seed"),
        ({"seed": 2.5}, "seed"),
    ],
)
def test_values_outside_the_schema_are_refused(fields: dict[str, Any], param: str) -> None:
    assert refused(body(**fields)).param == param


@pytest.mark.parametrize("text", [5, None, {"nested": "dict"}, ["a"]])
def test_a_text_part_must_hold_a_string(text: Any) -> None:
    """A dict's Python repr used to become the prompt."""
    request = body(messages=[{"role": "user", "content": [{"type": "text", "text": text}]}])
    assert refused(request).param == "messages[0].content"


def test_integral_numbers_are_integers() -> None:
    """JSON Schema's integer includes 2.0; so does the API (2.5 is refused above)."""
    submission = parse_chat_request(
        body(max_tokens=2.0, seed=float(1 << 40), n=1.0, stream_options={"include_usage": None})
    )
    assert submission.params.max_tokens == 2 and isinstance(submission.params.max_tokens, int)
    assert submission.params.seed == 1 << 40 and isinstance(submission.params.seed, int)
    assert submission.params.include_usage is False


def test_the_newer_max_tokens_name_wins() -> None:
    submission = parse_chat_request(body(max_tokens=5, max_completion_tokens=7))
    assert submission.params.max_tokens == 7
    assert parse_chat_request(body(max_tokens=5)).params.max_tokens == 5
