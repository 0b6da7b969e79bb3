"""Tool calls the model must make: ``tool_choice: "required"`` or a named function.

With ``tool_choice: "auto"`` the tools go to llama-server as they are, and the model's own chat
template decides (its tool calls stream back as ``delta.tool_calls``). A forced call must
happen whatever the model: the request is rewritten so that llama-server constrains the output
with a grammar to one JSON object ``{"name": ..., "arguments": {...}}`` matching one of the
allowed functions' parameter schemas (``response_format`` ``json_schema``), the functions are
described in a system message, and the answer is turned back into OpenAI's ``tool_calls``
(:func:`tool_calls_of`). Every model obeys; one call per turn.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

#: The system message that tells the model which functions it may call.
INSTRUCTIONS = (
    "You are a function-calling assistant. Answer only with one JSON object "
    '{"name": <function name>, "arguments": <object>} that calls one of these functions '
    "with arguments taken from the conversation:\n"
)


def forced_names(tools: list[dict[str, Any]], choice: Any) -> list[str] | None:
    """The functions the model must choose from, or None when the call is not forced."""
    if choice == "required":
        return [tool["function"]["name"] for tool in tools]
    if isinstance(choice, dict):
        return [choice["function"]["name"]]
    return None


def call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The JSON schema of one call of one of ``names``."""
    variants = []
    for tool in tools:
        function = tool["function"]
        if function["name"] not in names:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def force(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], names: list[str]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages with the functions described up front, and the ``response_format`` that
    constrains the answer to one call."""
    described = [
        {
            "name": tool["function"]["name"],
            "description": tool["function"].get("description", ""),
            "parameters": tool["function"].get("parameters") or {},
        }
        for tool in tools
        if tool["function"]["name"] in names
    ]
    system = {"role": "system", "content": INSTRUCTIONS + orjson.dumps(described).decode()}
    schema = call_schema(tools, names)
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "tool_call", "strict": True, "schema": schema},
    }
    return [system, *messages], response_format


def tool_calls_of(content: str, names: list[str]) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` for the model's constrained answer (None: not a whole call,
    e.g. cut off by ``max_tokens``)."""
    try:
        call = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments")
    if not isinstance(arguments, dict):
        return None
    return [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": call["name"], "arguments": orjson.dumps(arguments).decode()},
        }
    ]


def streamed(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``delta.tool_calls`` fragments of ``calls`` as OpenAI streams them: the id, type and
    name first with empty arguments, then the arguments in pieces."""
    fragments: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        head = {"name": call["function"]["name"], "arguments": ""}
        fragments.append({"index": index, "id": call["id"], "type": "function", "function": head})
        arguments = call["function"]["arguments"]
        half = len(arguments) // 2
        for piece in (arguments[:half], arguments[half:]):
            if piece:
                fragments.append({"index": index, "function": {"arguments": piece}})
    return fragments
