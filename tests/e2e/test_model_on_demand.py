"""End to end: a request for a model no node with room holds waits in the admission queue
while a node that lacks the file fetches it from a peer, then runs as its primary. The local
cluster's agent-b starts with an empty models directory; agent-a, which holds the model, is
drained. Real controller (embedded store), real agents, real llama.cpp."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from ops import paths
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, admin, cluster_fixture, get

pytestmark = pytest.mark.timeout(600)


cluster = cluster_fixture(
    "on-demand",
    AgentSpec("agent-a", 0, memory_limit=1024 * MIB, holds_model=True),
    AgentSpec("agent-b", 0, memory_limit=1024 * MIB),  # an empty models directory
)


def test_a_node_without_the_file_fetches_it_and_serves_the_waiting_request(
    cluster: LocalCluster,
) -> None:
    names = {row["name"]: row["node_id"] for row in get(cluster, "/api/admin/nodes")["data"]}
    drained = httpx.post(
        f"{cluster.url}/api/admin/nodes/{names['agent-a']}/drain",
        headers=admin(cluster),
        timeout=10,
    )
    assert drained.status_code == 202
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=300
    )
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
    )
    waited = time.monotonic() - started
    assert answer.choices[0].message.content
    job = get(cluster, f"/api/admin/jobs/{uuid.UUID(answer.id.removeprefix('chatcmpl-'))}")
    assert job["plan"]["primary"]["node_id"] == names["agent-b"]
    codes = [e["code"] for e in get(cluster, f"/api/admin/jobs/{job['job_id']}/events")["data"]]
    assert "JOB_QUEUED" in codes  # it waited for the file, not refused
    b = get(cluster, f"/api/admin/nodes/{names['agent-b']}")
    assert any(m["sha256"] == paths.MODEL_SHA256 for m in b["local_models"])
    fetched = cluster.config.var_dir / "agent-b" / "models" / paths.MODEL_FILE_NAME
    assert fetched.is_file() and not fetched.is_symlink()
    print(f"the request waited {waited:.1f} s, the fetch included")
