"""End to end: a model reaches a node that lacks it. The local cluster's agent-b starts with an
empty models directory; an operator pulls the model onto it (admin API); agent-b fetches it from
agent-a over TLS with a ticket, verifies it, reports it, and then serves a request as its
primary, agent-a drained. Real controller (Postgres), real agents, real llama.cpp."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any
from uuid import UUID

import httpx
import openai
import pytest

from domain.catalog import code_of
from ops import paths
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, admin, cluster_fixture, event_store

pytestmark = pytest.mark.timeout(600)


cluster = cluster_fixture(
    "distribution",
    AgentSpec("agent-a", 0, memory_limit=1024 * MIB, holds_model=True),
    AgentSpec("agent-b", 0, memory_limit=1024 * MIB),  # an empty models directory
    own_schema=True,
)


def nodes(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    rows = httpx.get(f"{cluster.url}/api/admin/nodes", headers=admin(cluster), timeout=10).json()
    return {row["name"]: row for row in rows["data"]}


def wait_for(check: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {check}")


def test_a_pulled_model_is_fetched_verified_and_served(cluster: LocalCluster) -> None:
    before = nodes(cluster)
    assert not before["agent-b"]["local_models"]
    pulled = httpx.post(
        f"{cluster.url}/api/admin/models/pull",
        headers=admin(cluster),
        json={"model": MODEL_NAME, "nodes": ["agent-b", "agent-a"]},
        timeout=10,
    )
    assert pulled.status_code == 202, pulled.text
    transfers = pulled.json()["transfers"]
    b_id, a_id = before["agent-b"]["node_id"], before["agent-a"]["node_id"]
    # agent-a holds it already: only agent-b fetches, from agent-a.
    assert [(t["node_id"], t["sources"]) for t in transfers] == [(b_id, [a_id])]

    def holds() -> bool:
        return any(
            m.get("sha256") == paths.MODEL_SHA256 for m in nodes(cluster)["agent-b"]["local_models"]
        )

    wait_for(holds)
    fetched = cluster.config.var_dir / "agent-b" / "models" / paths.MODEL_FILE_NAME
    assert fetched.is_file() and fetched.stat().st_size == paths.MODEL_SIZE
    assert not fetched.with_name(fetched.name + ".partial").exists()

    with event_store(cluster) as store:
        codes = [code_of(e) for e in store.events.get(UUID(b_id))]
    started = codes.index("MODEL_TRANSFER_STARTED")
    completed = codes.index("MODEL_TRANSFER_COMPLETED")
    assert started < completed and "MODEL_TRANSFER_PROGRESS" in codes[started:completed]

    models = httpx.get(f"{cluster.url}/api/admin/models", headers=admin(cluster), timeout=10)
    row = next(m for m in models.json()["data"] if m["name"] == MODEL_NAME)
    assert row["held_by"] == ["agent-a", "agent-b"]

    # With agent-a drained, agent-b serves the model as a primary of its own.
    drained = httpx.post(
        f"{cluster.url}/api/admin/nodes/{a_id}/drain", headers=admin(cluster), timeout=10
    )
    assert drained.status_code == 202
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=120
    )
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
    )
    assert answer.choices[0].message.content
    job_id = str(UUID(answer.id.removeprefix("chatcmpl-")))
    job = httpx.get(f"{cluster.url}/api/admin/jobs/{job_id}", headers=admin(cluster), timeout=10)
    assert job.json()["plan"]["primary"]["node_id"] == b_id

    # The operator deletes it from agent-b again: its idle llama-server lets the file go.
    evicted = subprocess.run(
        [
            sys.executable,
            "-m",
            "interfaces.cli.main",
            "models",
            "evict",
            MODEL_NAME,
            "--node",
            "agent-b",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DACP_URL": cluster.url, "ADMIN_API_KEY": cluster.admin_api_key},
    )
    assert evicted.returncode == 0, evicted.stderr
    assert f"deleted {paths.MODEL_FILE_NAME} from node agent-b" in evicted.stdout
    assert not fetched.exists()
    wait_for(lambda: not holds())
    with event_store(cluster) as store:
        assert "MODEL_EVICTED" in [code_of(e) for e in store.events.get(UUID(b_id))]


def test_a_pull_that_cannot_happen_says_why(cluster: LocalCluster) -> None:
    unknown = httpx.post(
        f"{cluster.url}/api/admin/models/pull",
        headers=admin(cluster),
        json={"model": MODEL_NAME, "nodes": ["no-such-node"]},
        timeout=10,
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "node_not_found"
    no_model = httpx.post(
        f"{cluster.url}/api/admin/models/pull",
        headers=admin(cluster),
        json={"model": "no-such-model", "nodes": ["agent-b"]},
        timeout=10,
    )
    assert no_model.status_code == 404
