"""End to end: a model that only the controller's model store holds (``dacp models add``)
reaches the node that needs it. The only agent starts with an empty models directory; a
request waits in the admission queue while the agent fetches the file from the controller
(TLS, its node certificate, a ticket), then it is served with that file. Real controller
(embedded store), real agent, real llama.cpp."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import openai
import pytest

from ops import paths
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, cluster_fixture, get

pytestmark = pytest.mark.timeout(600)


cluster = cluster_fixture(
    "from-store",
    AgentSpec("agent-a", 0, memory_limit=1024 * MIB),  # holds no model file
    store_model=True,
)


def test_a_model_only_the_controller_stores_is_fetched_and_served(cluster: LocalCluster) -> None:
    [model] = [m for m in get(cluster, "/api/admin/models")["data"] if m["name"] == MODEL_NAME]
    assert model["stored"]["layers"] > 0 and model["held_by"] == []
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=300
    )
    card = client.models.retrieve(MODEL_NAME)
    assert card.model_extra is not None and card.model_extra["available"] is True  # fetchable
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    job_id = uuid.UUID(chunks[0].id.removeprefix("chatcmpl-"))
    codes = [e["code"] for e in get(cluster, f"/api/admin/jobs/{job_id}/events")["data"]]
    assert "JOB_QUEUED" in codes and "JOB_COMPLETED" in codes
    [node] = get(cluster, "/api/admin/nodes")["data"]
    node_codes = [
        (e["code"], e["payload"])
        for e in get(cluster, f"/api/admin/nodes/{node['node_id']}/events")["data"]
    ]
    [(_, completed)] = [c for c in node_codes if c[0] == "MODEL_TRANSFER_COMPLETED"]
    assert completed["source_node_id"] == "controller"
    fetched = cluster.config.var_dir / "agent-a" / "models" / paths.MODEL_FILE_NAME
    assert fetched.is_file() and not fetched.is_symlink()
    assert fetched.stat().st_size == model["stored"]["size_bytes"]


def test_a_prompt_over_the_context_is_refused_before_any_node_sees_it(
    cluster: LocalCluster,
) -> None:
    """The controller holds the file, so it counts the prompt with the model's own template
    and tokenizer: a prompt of the slot's context or more is OpenAI's 400, streamed or not,
    chat or legacy, and no job is created (no node was asked). A prompt that fits is served."""
    before = {j["job_id"] for j in get(cluster, "/api/admin/jobs?limit=200")["data"]}
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=300
    )
    over: list[Any] = [{"role": "user", "content": "llamas and alpacas " * 800}]  # ~2,400
    attempts: list[tuple[str, Callable[[], object]]] = [
        ("messages", lambda: client.chat.completions.create(model=MODEL_NAME, messages=over)),
        (
            "messages",
            lambda: client.chat.completions.create(model=MODEL_NAME, messages=over, stream=True),
        ),
        (
            "prompt",
            lambda: client.completions.create(model=MODEL_NAME, prompt="alpaca " * 2100),
        ),
        ("prompt", lambda: client.completions.create(model=MODEL_NAME, prompt=[7] * 2048)),
    ]
    for param, attempt in attempts:
        with pytest.raises(openai.BadRequestError) as refused:
            attempt()
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param)
        assert "maximum context length is 2048 tokens" in refused.value.message
    after = {j["job_id"] for j in get(cluster, "/api/admin/jobs?limit=200")["data"]}
    assert after == before
    fits = client.completions.create(model=MODEL_NAME, prompt=[7] * 2047, max_tokens=1)
    assert fits.choices[0].finish_reason == "length"


def test_a_second_identical_chat_is_served_from_llama_servers_cache(
    cluster: LocalCluster,
) -> None:
    """The same long chat twice: the second goes back to the warm server holding its prefix,
    and llama-server's own count of the prompt tokens it took from its cache reaches the client
    (``usage.prompt_tokens_details.cached_tokens``, streamed) and the job's row."""
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=300
    )
    messages: list[Any] = [
        {"role": "system", "content": "You answer about camelids. " * 120},  # ~800 tokens
        {"role": "user", "content": "Which one spits?"},
    ]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert first.usage is not None and first.usage.prompt_tokens > 700
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 700 < cached <= usage.prompt_tokens
    job = get(cluster, f"/api/admin/jobs/{uuid.UUID(chunks[0].id.removeprefix('chatcmpl-'))}")
    assert job["cached_prompt_tokens"] == cached
    assert job["route"]["prefix"] == "hit" and job["route"]["matched_chars"] >= 2048
