"""The official Node ``openai`` SDK (from the npm registry, pinned in
``tests/conformance/node/package.json``, installed by ``make test``) against the same cluster:
the same checks as the Python suite, run by ``node/conformance.mjs``."""

from __future__ import annotations

import openai
import pytest

from tests.conformance.conftest import CHAT_MODEL, EMBED_MODEL
from tests.conformance.node_sdk import node_modules_ready, run_node_conformance
from tests.conformance.refused import REFUSED

pytestmark = pytest.mark.timeout(900)

CHECKS = (
    "tool_round_trip",
    "json_schema",
    "json_object",
    "logprobs",
    "stream_tool_calls",
    "embeddings",
    "completions",
    "refused",
)


def test_the_node_sdk_passes_every_check(client: openai.OpenAI, embedding_length: int) -> None:
    assert node_modules_ready(), "python3 -m ops.bootstrap test installs the Node SDK"
    results = run_node_conformance(
        str(client.base_url).rstrip("/"),
        client.api_key,
        CHAT_MODEL,
        EMBED_MODEL,
        embedding_length,
        REFUSED,
    )
    assert set(results) == set(CHECKS)
    failed = {check: detail for check, (ok, detail) in results.items() if not ok}
    assert failed == {}
