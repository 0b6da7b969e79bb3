"""Opens the controller's storage: the event store, its read-model views and their follower."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psycopg
from eventsourcing.persistence import InterfaceError, OperationalError
from eventsourcing.postgres import PostgresDatastore

from application.controller import Controller
from application.store_guard import StoreGuard, StoreUnavailable
from infrastructure.persistence import persistence_env
from infrastructure.projection_follower import ProjectionFollower
from infrastructure.read_model_store import ReadModelStore, open_read_model


def store_probe(env: Mapping[str, str]) -> Callable[[], bool]:
    """Whether the store answers now: for Postgres one connection (1 s timeout) and one
    query, outside the pool; an embedded SQLite file is always there."""
    if "POSTGRES_DBNAME" not in env:
        return lambda: True

    def probe() -> bool:
        try:
            with _connect(env, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    return probe


def _refresh_pools(*recorders: object) -> None:
    """After an outage: drop the pools' broken connections and connect again now. Left to
    themselves, psycopg's pools retry with a growing backoff, and requests would wait for
    a connection for seconds after the database is back."""
    for recorder in recorders:
        pool = getattr(getattr(recorder, "datastore", None), "pool", None)
        check = getattr(pool, "check", None)  # psycopg_pool's; SQLite has no pool to refresh
        if check is not None:
            check()


def fail_fast_on_outage(recorder: object, guard: StoreGuard) -> None:
    """The event store's first failure to get a connection trips ``guard`` and ends the
    command at once (:class:`StoreUnavailable`: a 503 with ``Retry-After``).

    eventsourcing's Postgres recorders retry an operational error ten times, and a pool that
    cannot connect takes its whole wait (``POOL_WAIT_SECONDS``) every time: the first command
    after the database stopped waited about 22 s for its answer unless something else had
    tripped the guard first (a read of the views, the follower losing its connection).
    Failing to get a connection at all is an outage, not a query to try again; an error on a
    connection already got (one the database dropped) is still retried by eventsourcing."""
    datastore = getattr(recorder, "datastore", None)
    if not isinstance(datastore, PostgresDatastore):
        return  # the embedded SQLite file has no such outage
    acquire = datastore.get_connection

    @contextlib.contextmanager
    def get_connection() -> Iterator[Any]:
        with contextlib.ExitStack() as stack:
            try:
                connection = stack.enter_context(acquire())
            except (OperationalError, InterfaceError) as e:
                guard.observe(e)
                raise StoreUnavailable(f"the event store is unreachable: {e}") from e
            yield connection

    cast(Any, datastore).get_connection = get_connection


def _connect(env: Mapping[str, str], **kwargs: object) -> psycopg.Connection[Any]:
    return psycopg.connect(
        dbname=env["POSTGRES_DBNAME"],
        host=env["POSTGRES_HOST"],
        port=int(env["POSTGRES_PORT"]),
        user=env["POSTGRES_USER"],
        password=env.get("POSTGRES_PASSWORD") or None,
        **kwargs,  # type: ignore[arg-type]
    )


def ensure_postgres_schema(env: Mapping[str, str]) -> None:
    """Creates ``POSTGRES_SCHEMA`` when one is configured (eventsourcing does not)."""
    schema = env.get("POSTGRES_SCHEMA")
    if not schema:
        return
    with _connect(env, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')  # type: ignore[arg-type]


@dataclass
class Storage:
    app: Controller
    read_model: ReadModelStore
    follower: ProjectionFollower
    env: dict[str, str]

    def start(self) -> Storage:
        self.follower.start()
        return self

    def close(self) -> None:
        self.follower.stop()
        self.app.guard.close()
        self.app.close()
        factory = getattr(self.read_model, "factory", None)
        if factory is not None:
            factory.close()


def open_storage(
    env: Mapping[str, str], *, record_content: bool = True, poll_interval: float = 0.5
) -> Storage:
    """Opens storage from an eventsourcing environment (see :func:`persistence_env`)."""
    env = dict(env)
    ensure_postgres_schema(env)
    guard = StoreGuard(store_probe(env))
    app = Controller(env=env, record_content=record_content, guard=guard)
    fail_fast_on_outage(app.recorder, guard)
    store = open_read_model(env)
    cast(Any, store).guard = guard
    guard.on_back = lambda: _refresh_pools(app.recorder, store)
    follower = ProjectionFollower(app, store, poll_interval=poll_interval)
    return Storage(app=app, read_model=store, follower=follower, env=env)


def storage_from_url(
    database_url: str | None,
    *,
    var_dir: Path = Path("var"),
    pool_size: int = 5,
    record_content: bool = True,
) -> Storage:
    env = persistence_env(database_url, var_dir=var_dir, pool_size=pool_size)
    return open_storage(env, record_content=record_content)
