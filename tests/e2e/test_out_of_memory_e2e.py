"""End to end: a real out-of-memory on an RPC worker, and the re-plan around it.

Three agents on real llama.cpp: ``primary`` holds the model but cannot hold it alone; ``tight``
offers the most memory, so the first plan splits the model over ``primary`` and ``tight``, but
its ``ggml-rpc-server`` runs under an address-space limit (``ulimit -v``, an operator's own
build through ``--llama-bin-dir``) far below its share, so llama.cpp fails to allocate the
buffer the plan gave it; ``roomy`` offers a little less. The controller hears the primary's
out-of-memory, names the device (``tight``'s ``CPU``) in ``JOB_REPLANNED``, lowers its budget,
and the job runs on ``primary`` and ``roomy``. The client only sees a completion.
"""

from __future__ import annotations

import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from application.controller import Controller
from common.contract import HOST_DEVICE, OUT_OF_MEMORY
from domain.catalog import code_of
from ops import artifacts, paths
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, cluster_on_own_schema, event_store, get

pytestmark = pytest.mark.timeout(600)
#: The tight worker's address space (KiB): its idle process takes about 9 MiB; its share of the
#: weights alone is over 50 MiB.
TIGHT_ADDRESS_SPACE_KIB = 40 * 1024


def tight_build(directory: Path) -> Path:
    """A llama.cpp "build" whose ggml-rpc-server runs under ``ulimit -v``: the real binaries,
    linked, but for a wrapper script in front of the RPC server."""
    real = paths.llama_bin_dir()
    directory.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name not in ("ggml-rpc-server", "rpc-server"):
            (directory / entry.name).symlink_to(entry)
    wrapper = directory / "ggml-rpc-server"
    wrapper.write_text(
        f'#!/bin/sh\nulimit -v {TIGHT_ADDRESS_SPACE_KIB}\nexec "{real / "ggml-rpc-server"}" "$@"\n',
        encoding="utf-8",
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    artifacts.ensure_llama()  # the tight build links its binaries
    var = tmp_path_factory.mktemp("oom-cluster")
    build = tmp_path_factory.mktemp("tight-build")  # the cluster empties its own folder
    yield from cluster_on_own_schema(
        var,
        AgentSpec("primary", 0, memory_limit=150 * MIB, holds_model=True),
        AgentSpec(
            "tight",
            0,
            memory_limit=200 * MIB,
            extra_args=("--llama-bin-dir", str(tight_build(build))),
        ),
        AgentSpec("roomy", 0, memory_limit=180 * MIB),
        extra_env={"RPC_WORKER_START_TIMEOUT": "8"},
    )


@pytest.fixture(scope="module")
def store(cluster: LocalCluster) -> Iterator[Controller]:
    with event_store(cluster) as app:
        yield app


def events_of(store: Controller, job_id: str) -> list[tuple[str, Any]]:
    out = []
    for n in store.recorder.select_notifications(start=1, limit=1_000_000):
        event = store.mapper.to_domain_event(n)
        if str(event.originator_id) == job_id:
            out.append((code_of(event), event))
    return out


def node_ids(cluster: LocalCluster) -> dict[str, str]:
    rows = get(cluster, "/api/admin/nodes")["data"]
    return {row["name"]: row["node_id"] for row in rows}


def test_a_worker_out_of_memory_is_replanned_around_and_named(
    cluster: LocalCluster, store: Controller
) -> None:
    client = openai.OpenAI(
        base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=120
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    job_id = str(uuid.UUID(chunks[0].id.removeprefix("chatcmpl-")))
    names = node_ids(cluster)
    deadline = time.monotonic() + 30
    while store.get_job(job_id).state != "COMPLETED":
        assert time.monotonic() < deadline, store.get_job(job_id).state
        time.sleep(0.1)

    events = events_of(store, job_id)
    planned = [e for code, e in events if code == "JOB_PLANNED"]
    replanned = [e for code, e in events if code == "JOB_REPLANNED"]
    # The first plan gave the tight worker's CPU its share, over RPC ...
    first = planned[0].plan
    assert [w["node_id"] for w in first["workers"]] == [names["tight"]]
    tight_share = next(d for d in first["devices"] if d["node_id"] == names["tight"])
    assert tight_share["device"] == HOST_DEVICE
    # ... which llama.cpp could not allocate: the re-plan names that device and its bytes.
    assert replanned, [code for code, _ in events]
    oom = replanned[0].out_of_memory
    assert oom["node_id"] == names["tight"] and oom["device"] == HOST_DEVICE
    assert oom["planned_bytes"] == tight_share["assigned_bytes"]
    assert oom["asked_bytes"] > TIGHT_ADDRESS_SPACE_KIB * 1024 // 2
    assert OUT_OF_MEMORY in replanned[0].reason and HOST_DEVICE in replanned[0].reason
    assert replanned[0].excluded_node == ""  # the node stays; its device gets less
    # The job ran on the roomy worker instead.
    final = store.get_job(job_id).plan
    assert final is not None
    assert [w["node_id"] for w in final["workers"]] == [names["roomy"]]
    # The tight worker's own output says what llama.cpp could not allocate.
    log = (cluster.config.var_dir / "tight" / "logs").rglob("rpc-worker-*.log")
    assert any("failed to allocate buffer" in path.read_text(errors="replace") for path in log)
