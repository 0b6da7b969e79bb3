"""What the end-to-end tests on a local cluster share: starting one (llama.cpp and the test
model made sure of first; on a Postgres schema of its own when a test reads its events) and
reading its admin API and its event store."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import psutil
import pytest

from application.controller import Controller
from infrastructure.persistence import persistence_env
from ops import artifacts
from ops.local_cluster import AgentSpec, ClusterConfig, LocalCluster
from tests.conftest import TEST_DATABASE_URL, _drop_schema

MIB = 1 << 20


@contextmanager
def started_cluster(var_dir: Path, *agents: AgentSpec, **config: Any) -> Iterator[LocalCluster]:
    """A running local cluster (any free ports, quiet)."""
    artifacts.ensure_llama()
    artifacts.ensure_model()
    settings = ClusterConfig(var_dir=var_dir, port=0, grpc_port=0, agents=agents, quiet=True)
    for key, value in config.items():
        setattr(settings, key, value)
    with LocalCluster(settings) as running:
        yield running


def local_cluster(var_dir: Path, *agents: AgentSpec, **config: Any) -> Iterator[LocalCluster]:
    """A running local cluster (any free ports, quiet) for a module-scoped fixture to yield."""
    with started_cluster(var_dir, *agents, **config) as running:
        yield running


def cluster_on_own_schema(
    var_dir: Path, *agents: AgentSpec, **config: Any
) -> Iterator[LocalCluster]:
    """:func:`local_cluster` on a fresh Postgres schema, dropped afterwards; its events are read
    with :func:`event_store`."""
    schema = f"t_e2e_{uuid.uuid4().hex[:8]}"
    database_url = f"{TEST_DATABASE_URL}?schema={schema}"
    yield from local_cluster(var_dir, *agents, database_url=database_url, **config)
    _drop_schema(schema)


def cluster_fixture(
    folder: str, *agents: AgentSpec, own_schema: bool = False, **config: Any
) -> Callable[..., object]:
    """A module-scoped fixture named ``cluster``: :func:`local_cluster` (or, with
    ``own_schema``, :func:`cluster_on_own_schema`) in a fresh temporary ``folder``."""
    start = cluster_on_own_schema if own_schema else local_cluster

    def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
        yield from start(tmp_path_factory.mktemp(folder), *agents, **config)

    return pytest.fixture(scope="module")(cluster)


@contextmanager
def event_store(cluster: LocalCluster) -> Iterator[Controller]:
    """A Controller over the event store of a :func:`cluster_on_own_schema` cluster."""
    url = cluster.config.database_url
    assert url is not None, "the cluster runs on the embedded store"
    [schema] = parse_qs(urlsplit(url).query)["schema"]
    app = Controller(env=persistence_env(TEST_DATABASE_URL, schema=schema))
    try:
        yield app
    finally:
        app.close()


def running(binary: str, marker: str) -> list[list[str]]:
    """The command lines of this test's processes running ``binary`` with ``marker``."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if cmdline and os.path.basename(cmdline[0]) == binary and marker in cmdline:
            found.append(cmdline)
    return found


def admin(cluster: LocalCluster) -> dict[str, str]:
    return {"Authorization": f"Bearer {cluster.admin_api_key}"}


def get(cluster: LocalCluster, path: str) -> Any:
    """The JSON of an admin API GET."""
    return httpx.get(f"{cluster.url}{path}", headers=admin(cluster), timeout=10).json()
