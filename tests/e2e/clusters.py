"""What the end-to-end tests on a local cluster share: starting one (llama.cpp and the test
model made sure of first) and reading its admin API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from ops import paths
from ops.local_cluster import AgentSpec, ClusterConfig, LocalCluster

MIB = 1 << 20


def local_cluster(var_dir: Path, *agents: AgentSpec, **config: Any) -> Iterator[LocalCluster]:
    """A running local cluster (any free ports, quiet) for a module-scoped fixture to yield."""
    paths.ensure_llama()
    paths.ensure_model()
    settings = ClusterConfig(var_dir=var_dir, port=0, grpc_port=0, agents=agents, quiet=True)
    for key, value in config.items():
        setattr(settings, key, value)
    with LocalCluster(settings) as running:
        yield running


def admin(cluster: LocalCluster) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster.admin_api_key}"}


def get(cluster: LocalCluster, path: str) -> Any:
    """The JSON of an admin API GET."""
    return httpx.get(f"{cluster.url}{path}", headers=admin(cluster), timeout=10).json()
