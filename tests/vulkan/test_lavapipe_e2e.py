"""End to end on a Vulkan device: the Vulkan backend of the pinned llama.cpp, on lavapipe (Mesa's
software Vulkan device), split over two agents' devices.

Opt-in (``make test-vulkan``; not part of ``make test``): the Vulkan build takes about 23
minutes on two cores (shader generation, then the backend), and lavapipe computes on the CPU
through Vulkan, a minute or more per request here. It needs ``glslc``, the Vulkan loader and
``mesa-vulkan-drivers`` (Debian: ``apt install glslc libvulkan-dev mesa-vulkan-drivers``);
the build fetches newer Vulkan headers where the system's are too old (ops/vulkan_headers.py).

llama.cpp leaves CPU-type Vulkan devices out unless ``GGML_VK_VISIBLE_DEVICES`` names them, so
the agents run with ``GGML_VK_VISIBLE_DEVICES=0``: lavapipe becomes ``Vulkan0`` (2048 MiB).
Each agent offers 700 MiB (``--memory-limit``): a device's room is then 188 MiB after the
compute reserve, too little for the model alone, so the plan splits it over both devices, the
second over RPC (tier ``gpus_over_rpc``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from agent.runtime.llama_backend import VULKAN
from ops import artifacts
from ops.local_cluster import MODEL_NAME, AgentSpec, ClusterConfig, LocalCluster
from tests.e2e.clusters import running

pytestmark = [pytest.mark.vulkan, pytest.mark.timeout(3600)]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    artifacts.ensure_llama(VULKAN)
    artifacts.ensure_model()
    before = os.environ.get("GGML_VK_VISIBLE_DEVICES")
    os.environ["GGML_VK_VISIBLE_DEVICES"] = "0"  # the agents inherit it
    vulkan = ("--llama-backend", VULKAN)
    config = ClusterConfig(
        var_dir=tmp_path_factory.mktemp("vulkan-cluster"),
        port=0,
        grpc_port=0,
        agents=(
            AgentSpec("vk-a", 0, memory_limit=700 * MIB, holds_model=True, extra_args=vulkan),
            AgentSpec("vk-b", 0, memory_limit=700 * MIB, extra_args=vulkan),
        ),
        extra_env={"SETUP_TIMEOUT": "900", "RPC_WORKER_START_TIMEOUT": "60"},
        quiet=True,
    )
    try:
        with LocalCluster(config) as running:
            yield running
    finally:
        if before is None:
            os.environ.pop("GGML_VK_VISIBLE_DEVICES", None)
        else:
            os.environ["GGML_VK_VISIBLE_DEVICES"] = before


def admin_get(cluster: LocalCluster, path: str) -> object:
    headers = {"Authorization": f"Bearer {cluster.admin_api_key}"}
    return httpx.get(f"{cluster.url}/api/admin{path}", headers=headers, timeout=30).json()


def test_a_split_over_two_vulkan_devices_streams_through_the_controller(
    cluster: LocalCluster,
) -> None:
    nodes = admin_get(cluster, "/nodes")["data"]  # type: ignore[index]
    for node in nodes:
        names = [d["name"] for d in node["devices"]]
        assert names[0] == "Vulkan0" and "llvmpipe" in node["devices"][0]["description"]
        assert node["llama"]["backend"] == VULKAN
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=1800
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Name one colour."}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    job_id = str(uuid.UUID(chunks[0].id.removeprefix("chatcmpl-")))
    plan = admin_get(cluster, f"/jobs/{job_id}")["plan"]  # type: ignore[index]
    by_name = {n["node_id"]: n["name"] for n in nodes}
    assert plan["tier"] == "gpus_over_rpc"
    assert [(by_name[d["node_id"]], d["device"], d["via_rpc"]) for d in plan["devices"]] == [
        ("vk-a", "Vulkan0", False),
        ("vk-b", "Vulkan0", True),
    ]
    [server] = running("llama-server", "--rpc")
    assert server[server.index("--device") + 1] == "Vulkan0,RPC0"
    workers = running("ggml-rpc-server", "--device")
    assert any(w[w.index("--device") + 1] == "Vulkan0" for w in workers)
