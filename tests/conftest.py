"""Shared fixtures: real Postgres (a fresh schema per test) and real SQLite files."""

from __future__ import annotations

# Before anything imports grpc: tests run a controller's or an agent's gRPC in the process that
# forks llama.cpp children, which gRPC's fork handlers would break (see agent/grpc_fork.py).
import agent.grpc_fork  # noqa: F401  # isort: skip

import dataclasses
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from infrastructure.persistence import persistence_env
from infrastructure.settings import Settings
from infrastructure.storage import Storage, ensure_postgres_schema, open_storage
from tests.faults.services import OwnPostgres

# No test reads or writes the operator's own config file or state directory: each test gets
# its own XDG_CONFIG_HOME (see `_own_config`), and the session one is a fresh directory too.
for _name in ("DACP_CONFIG", "DACP_URL", "DACP_VAR_DIR"):
    os.environ.pop(_name, None)
_SESSION_XDG = Path(tempfile.mkdtemp(prefix="dacp-tests-xdg-"))
os.environ["XDG_CONFIG_HOME"] = str(_SESSION_XDG / "config")
os.environ["XDG_DATA_HOME"] = str(_SESSION_XDG / "data")

TEST_DATABASE_URL = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _drop_schema(schema: str) -> None:
    with psycopg.connect(TEST_DATABASE_URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _own_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config file a controller writes at its first start is this test's alone."""
    home = tmp_path_factory.mktemp("xdg")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))


@pytest.fixture
def postgres_env() -> Iterator[dict[str, str]]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    env = persistence_env(TEST_DATABASE_URL, schema=schema, pool_size=4)
    ensure_postgres_schema(env)
    yield env
    _drop_schema(schema)


@pytest.fixture
def sqlite_env(tmp_path: Path) -> dict[str, str]:
    return persistence_env(f"sqlite:///{tmp_path / 'events.sqlite3'}")


@pytest.fixture(params=["postgres", "sqlite"])
def store_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """Each test using this runs once on real Postgres and once on SQLite."""
    name = "postgres_env" if request.param == "postgres" else "sqlite_env"
    env: dict[str, str] = request.getfixturevalue(name)
    return env


@pytest.fixture
def storage(store_env: dict[str, str]) -> Iterator[Storage]:
    s = open_storage(store_env, poll_interval=0.2).start()
    yield s
    s.close()


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    """A private PostgreSQL cluster (tests/faults/services.py) a test may stop and pause."""
    server = OwnPostgres().init().start()
    yield server
    server.close()


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A fresh Postgres schema; also names the test's Redis keys, removed afterwards."""
    import redis

    schema = f"t_{uuid.uuid4().hex[:12]}"
    yield schema
    _drop_schema(schema)
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for key in client.scan_iter(match=f"dacp-test:{schema}:*"):
        client.delete(key)


def controller_settings(schema: str, tmp_path: Path, **overrides: object) -> Settings:
    """Settings for a controller on real Postgres (own schema) and real Redis, free ports."""
    base = Settings(
        database_url=f"{TEST_DATABASE_URL}?schema={schema}",
        redis_url=TEST_REDIS_URL,
        redis_key_prefix=f"dacp-test:{schema}:",
        ai_api_key="test-ai-key",
        admin_api_key="test-admin-key",
        node_enrollment_secret="test-enrollment-secret",
        port=0,
        grpc_port=0,
        model_store_port=0,
        heartbeat_interval=0.2,
        degraded_after=1.0,
        offline_after=2.0,
        # Several recording rounds per short test stream (the default is 1 s).
        token_record_interval=0.2,
        var_dir=tmp_path / "var",
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]
