"""The requests both SDK suites send that must be refused: a field we cannot honour, each
with the ``param`` the 400 must name (shared by the Python and Node conformance tests)."""

from __future__ import annotations

from typing import Any

#: ``{"endpoint", "body" (merged into a minimal valid request), "param"}``.
REFUSED: list[dict[str, Any]] = [
    {"endpoint": "chat", "body": {"n": 2}, "param": "n"},
    {"endpoint": "chat", "body": {"audio": {"voice": "alloy", "format": "wav"}}, "param": "audio"},
    {"endpoint": "chat", "body": {"modalities": ["text", "audio"]}, "param": "modalities"},
    {
        "endpoint": "chat",
        "body": {"prediction": {"type": "content", "content": "x"}},
        "param": "prediction",
    },
    {"endpoint": "chat", "body": {"web_search_options": {}}, "param": "web_search_options"},
    {"endpoint": "chat", "body": {"reasoning_effort": "low"}, "param": "reasoning_effort"},
    {"endpoint": "chat", "body": {"verbosity": "low"}, "param": "verbosity"},
    {"endpoint": "chat", "body": {"service_tier": "flex"}, "param": "service_tier"},
    {"endpoint": "chat", "body": {"store": True}, "param": "store"},
    {"endpoint": "chat", "body": {"prompt_cache_key": "k"}, "param": "prompt_cache_key"},
    {
        "endpoint": "chat",
        "body": {"prompt_cache_retention": "24h"},
        "param": "prompt_cache_retention",
    },
    {"endpoint": "chat", "body": {"moderation": {"model": "m"}}, "param": "moderation"},
    {
        "endpoint": "chat",
        "body": {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
        "param": "functions",
    },
    {"endpoint": "chat", "body": {"function_call": "auto"}, "param": "function_call"},
    {
        "endpoint": "chat",
        "body": {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
            ]
        },
        "param": "messages[0].content",
    },
    {"endpoint": "chat", "body": {"tool_choice": "auto"}, "param": "tool_choice"},
    {
        "endpoint": "chat",
        "body": {"stream_options": {"include_obfuscation": True}},
        "param": "stream_options.include_obfuscation",
    },
    {"endpoint": "chat", "body": {"no_such_field": 1}, "param": "no_such_field"},
    {"endpoint": "completions", "body": {"n": 2}, "param": "n"},
    {"endpoint": "completions", "body": {"best_of": 3}, "param": "best_of"},
    {"endpoint": "completions", "body": {"echo": True}, "param": "echo"},
    {"endpoint": "completions", "body": {"suffix": "end"}, "param": "suffix"},
    {"endpoint": "completions", "body": {"prompt": ["one", "two"]}, "param": "prompt"},
    {"endpoint": "embeddings", "body": {"dimensions": 64}, "param": "dimensions"},
    {"endpoint": "embeddings", "body": {"encoding_format": "int8"}, "param": "encoding_format"},
]
