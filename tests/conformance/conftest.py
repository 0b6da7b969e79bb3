"""The conformance cluster: the local cluster (controller on the embedded store, two agents
with real llama.cpp) serving SmolLM2 as a chat model and, registered a second time, as an
embedding model with mean pooling. Each agent holds the file and offers enough memory for a
whole server, so the chat and the embedding server run side by side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.gguf_metadata import read_gguf_metadata
from ops import paths
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, admin, started_cluster

CHAT_MODEL = MODEL_NAME
EMBED_MODEL = "smollm2-135m-embed"


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with started_cluster(
        tmp_path_factory.mktemp("conformance"),
        AgentSpec("agent-a", 0, memory_limit=1024 * MIB, holds_model=True),
        AgentSpec("agent-b", 0, memory_limit=1024 * MIB, holds_model=True),
    ) as running:
        registered = httpx.post(
            f"{running.url}/api/admin/models",
            headers=admin(running),
            json={
                "name": EMBED_MODEL,
                "sha256": paths.MODEL_SHA256,
                "file_name": paths.MODEL_FILE_NAME,
                "kind": "embedding",
                "pooling": "mean",
            },
            timeout=10,
        )
        assert registered.status_code == 201, registered.text
        yield running


@pytest.fixture(scope="package")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="package")
def embedding_length() -> int:
    """The model's own vector length, from its GGUF."""
    return read_gguf_metadata(Path(paths.model_path())).embedding_length
