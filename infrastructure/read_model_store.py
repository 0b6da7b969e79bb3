"""Projection views (``nodes``, ``jobs``, ``eligibility``) in the event store's database.

Each event is applied in one transaction together with eventsourcing's tracking record,
so a view sees every event exactly once, and restarts from its tracked position. The same
SQL serves Postgres and SQLite: only the placeholder and the table qualification differ.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import orjson
from eventsourcing.persistence import InfrastructureFactory, Tracking
from eventsourcing.postgres import PostgresTrackingRecorder
from eventsourcing.sqlite import SQLiteTrackingRecorder
from eventsourcing.utils import Environment
from psycopg.sql import SQL

from application.read_models import (
    eligibility_of,
    project_api_key,
    project_job,
    project_model,
    project_node,
    project_refusal,
    project_token,
)
from application.store_guard import StoreGuard
from application.usage import UsageQuery
from domain.access_refusal import AccessRefusal
from domain.api_key import ApiKey
from domain.issued_token import IssuedToken
from domain.job import Job
from domain.model import RegisteredModel
from domain.node import Node

#: The ``jobs`` view's columns for usage accounting (``application/usage.py``), with their
#: SQL types: views made before them get them at open (:meth:`_ReadModelViews.migrate_views`).
USAGE_COLUMNS = (
    ("key_id", "TEXT NOT NULL DEFAULT ''"),
    ("ended_at", "TEXT"),
    ("prompt_tokens", "BIGINT"),
    ("completion_tokens", "BIGINT"),
)
#: What usage is grouped by: the SQL of each group and its name in a row.
_USAGE_GROUPS = {
    "key": ("key_id", "key_id"),
    "model": ("model", "model"),
    "day": ("substr(ended_at, 1, 10)", "day"),
}

VIEW_TABLES = (
    "nodes",
    "eligibility",
    "jobs",
    "job_nodes",
    "models",
    "skips",
    "refusals",
    "tokens",
    "api_keys",
)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _loads(raw: Any) -> Any:
    return orjson.loads(raw) if raw is not None else None


_KEYS = {
    "nodes": "node_id",
    "models": "model_id",
    "jobs": "job_id",
    "refusals": "refusal_id",
    "tokens": "token_uuid",
    "api_keys": "key_id",
}


class _Batch:
    """Rows a batch of events changes: each read at most once, written once at the end."""

    def __init__(self, views: _ReadModelViews, c: Any) -> None:
        self.views, self.c = views, c
        self.before: dict[tuple[str, str], dict[str, Any] | None] = {}
        self.after: dict[tuple[str, str], dict[str, Any]] = {}

    def _row(self, table: str, ident: str) -> dict[str, Any] | None:
        key = (table, ident)
        if key in self.after:
            return self.after[key]
        if key not in self.before:
            self.before[key] = self.views._select(self.c, table, ident)
        return self.before[key]

    def prefetch(self, events: Sequence[object]) -> None:
        """Reads every row the events touch: one query per table, not one per row."""
        wanted: dict[str, set[str]] = {}
        for event in events:
            table = _table_of(event)
            if table is not None:
                wanted.setdefault(table, set()).add(str(getattr(event, "originator_id", "")))
        for table, idents in wanted.items():
            rows = self.views._select_many(self.c, table, sorted(idents))
            for ident in idents:
                self.before[(table, ident)] = rows.get(ident)

    def stage(self, event: object) -> None:
        table = _table_of(event)
        if table is None:
            return
        ident = str(getattr(event, "originator_id", ""))
        row = _PROJECT[table](self._row(table, ident), event)
        if row is not None:
            self.after[(table, ident)] = row

    def write(self) -> None:
        views, c = self.views, self.c
        jobs = []
        for (table, ident), row in self.after.items():
            if table == "nodes":
                views._write_node(c, ident, row)
            elif table == "refusals":
                views._write_refusal(c, ident, row)
            elif table == "tokens":
                views._write_token(c, ident, row)
            elif table == "api_keys":
                views._write_api_key(c, ident, row)
            elif table == "models":
                views._write_model(c, ident, row)
            else:
                jobs.append((ident, row, self.before.get((table, ident))))
        views._write_jobs(c, jobs)


def _table_of(event: object) -> str | None:
    if isinstance(event, AccessRefusal.Refused):
        return "refusals"
    if isinstance(event, IssuedToken.Minted | IssuedToken.Revoked):
        return "tokens"
    if isinstance(event, ApiKey.Created | ApiKey.Event):
        return "api_keys"
    if isinstance(event, Node.Event):
        return "nodes"
    if isinstance(event, RegisteredModel.Event):
        return "models"
    if isinstance(event, Job.Event):
        return "jobs"
    return None


_PROJECT = {
    "nodes": project_node,
    "models": project_model,
    "jobs": project_job,
    "refusals": project_refusal,
    "tokens": project_token,
    "api_keys": project_api_key,
}


@contextlib.contextmanager
def _guarded(
    transaction: contextlib.AbstractContextManager[Any], guard: StoreGuard | None
) -> Iterator[Any]:
    """``transaction``, telling ``guard`` about the errors that show an outage."""
    try:
        with transaction as c:
            yield c
    except BaseException as e:
        if guard is not None:
            guard.observe(e)
        raise


class _ReadModelViews:
    """SQL of the views; mixed into a database-specific tracking recorder."""

    ph = "?"
    view_name = "dacp_readmodel"
    #: The store's circuit breaker (open_storage sets it): no pool wait during an outage.
    guard: StoreGuard | None = None

    def _transaction(self, *, commit: bool) -> contextlib.AbstractContextManager[Any]:
        if self.guard is not None:
            self.guard.check()
        return _guarded(cast(Any, self).datastore.transaction(commit=commit), self.guard)

    def _t(self, table: str) -> str:
        return f"{self.view_name}_{table}"

    def _sql(self, statement: str) -> str:
        return statement.replace("?", self.ph)

    def view_statements(self) -> list[str]:
        return [
            f"CREATE TABLE IF NOT EXISTS {self._t('nodes')} ("
            "node_id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL, "
            "data TEXT NOT NULL)",
            f"CREATE TABLE IF NOT EXISTS {self._t('eligibility')} ("
            "node_id TEXT PRIMARY KEY, fallback_only INTEGER NOT NULL, "
            "free_memory_bytes BIGINT NOT NULL, data TEXT NOT NULL)",
            f"CREATE TABLE IF NOT EXISTS {self._t('jobs')} ("
            "job_id TEXT PRIMARY KEY, state TEXT NOT NULL, model TEXT NOT NULL, "
            "submitted_at TEXT NOT NULL, data TEXT NOT NULL, "
            + ", ".join(f"{name} {kind}" for name, kind in USAGE_COLUMNS)
            + ")",
            f"CREATE TABLE IF NOT EXISTS {self._t('job_nodes')} ("
            "job_id TEXT NOT NULL, node_id TEXT NOT NULL, PRIMARY KEY (job_id, node_id))",
            f"CREATE TABLE IF NOT EXISTS {self._t('models')} ("
            "model_id TEXT PRIMARY KEY, name TEXT NOT NULL, data TEXT NOT NULL)",
            # Enrollment tokens minted (and perhaps revoked) through dacp.
            f"CREATE TABLE IF NOT EXISTS {self._t('tokens')} ("
            "token_uuid TEXT PRIMARY KEY, minted_at TEXT NOT NULL, data TEXT NOT NULL)",
            # Managed inference keys (API_KEY_*): their terms, never their hash.
            f"CREATE TABLE IF NOT EXISTS {self._t('api_keys')} ("
            "key_id TEXT PRIMARY KEY, created_at TEXT NOT NULL, data TEXT NOT NULL)",
            # Refused enrollments and control streams (ACCESS_REFUSED), newest last.
            f"CREATE TABLE IF NOT EXISTS {self._t('refusals')} ("
            "refusal_id TEXT PRIMARY KEY, node_id TEXT NOT NULL, node_name TEXT NOT NULL, "
            "at TEXT NOT NULL, data TEXT NOT NULL)",
            # Events the views could not take (the follower skipped them), for diagnosis.
            f"CREATE TABLE IF NOT EXISTS {self._t('skips')} ("
            "notification_id BIGINT PRIMARY KEY, originator_id TEXT NOT NULL, "
            "data TEXT NOT NULL)",
            f"CREATE INDEX IF NOT EXISTS {self.view_name}_jobs_submitted "
            f"ON {self._t('jobs')} (submitted_at)",
        ]

    def migrate_views(self) -> None:
        """Brings views made by an earlier version up to date, at every open (idempotent, safe
        for two controllers starting at once): a ``jobs`` view without the usage columns gets
        them (:data:`USAGE_COLUMNS`), filled from each row's data, and their index."""
        with cast(Any, self).datastore.transaction(commit=True) as c:
            have = self._columns(c, "jobs")
            missing = [(name, kind) for name, kind in USAGE_COLUMNS if name not in have]
            for name, kind in missing:
                c.execute(f"ALTER TABLE {self._t('jobs')} ADD COLUMN {self._add} {name} {kind}")
            if missing:
                json = self._json_field
                c.execute(
                    f"UPDATE {self._t('jobs')} SET key_id = COALESCE({json('key_id')}, ''), "
                    f"ended_at = {json('ended_at')}, "
                    f"prompt_tokens = {json('prompt_tokens', number=True)}, "
                    f"completion_tokens = {json('completion_tokens', number=True)}"
                )
            c.execute(
                f"CREATE INDEX IF NOT EXISTS {self.view_name}_jobs_ended "
                f"ON {self._t('jobs')} (ended_at)"
            )

    #: How ``ALTER TABLE`` adds a column (Postgres: only when it is not there yet).
    _add = ""

    def _columns(self, c: Any, table: str) -> set[str]:
        c.execute(f"PRAGMA table_info({self._t(table)})")
        return {str(row["name"]) for row in c.fetchall()}

    def _json_field(self, name: str, *, number: bool = False) -> str:
        """SQL reading the top-level field ``name`` of a row's ``data`` (null when absent)."""
        return f"json_extract(data, '$.{name}')"

    def _has_table(self, c: Any, table: str) -> bool:
        c.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
            (f"{self.view_name}_{table}",),
        )
        return c.fetchone() is not None

    # ------------------------------------------------------------------ writes

    def process_event(self, event: object, tracking: Tracking) -> None:
        """Applies one event to the views and records ``tracking``, atomically."""
        with self._transaction(commit=True) as c:
            # Tracking first: on SQLite a transaction that reads before it writes cannot
            # upgrade to a writer once another connection has committed (SQLITE_BUSY).
            cast(Any, self)._insert_tracking(c, tracking)
            self._apply(c, event)

    def process_events(self, items: Sequence[tuple[object, Tracking]]) -> None:
        """Applies several events and records their tracking, atomically: each row they touch
        is read once and written once (a batch of token chunks of one job is one update)."""
        if not items:
            return
        with self._transaction(commit=True) as c:
            # Tracking first, as in process_event. With eventsourcing's single-row tracking
            # (the default), recording the first position refuses a batch that overlaps what
            # another follower applied, and the last position advances the row.
            insert = cast(Any, self)._insert_tracking
            trackings = [tracking for _, tracking in items]
            if cast(Any, self).datastore.single_row_tracking:
                trackings = list(dict.fromkeys([trackings[0], trackings[-1]]))
            for tracking in trackings:
                insert(c, tracking)
            batch = _Batch(self, c)
            events = [event for event, _ in items]
            batch.prefetch(events)
            for event in events:
                batch.stage(event)
            batch.write()

    def record_skip(self, tracking: Tracking, skip: Mapping[str, Any]) -> None:
        """Records that the event at ``tracking`` was skipped (``skip``: its
        ``notification_id``, ``originator_id``, ``event``, ``error``, ``skipped_at``), and
        its tracking, atomically: the views move on past it, and say so."""
        with self._transaction(commit=True) as c:
            cast(Any, self)._insert_tracking(c, tracking)
            c.execute(
                self._sql(
                    f"INSERT INTO {self._t('skips')} (notification_id, originator_id, data) "
                    "VALUES (?, ?, ?)"
                ),
                (skip["notification_id"], str(skip["originator_id"]), _dumps(dict(skip))),
            )

    def list_skips(self, originator_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The skipped events (of ``originator_ids`` only, when given), oldest first."""
        if originator_ids is None:
            return self._all(f"SELECT data FROM {self._t('skips')} ORDER BY notification_id")
        if not originator_ids:
            return []
        marks = ", ".join("?" for _ in originator_ids)
        return self._all(
            f"SELECT data FROM {self._t('skips')} WHERE originator_id IN ({marks}) "
            "ORDER BY notification_id",
            tuple(originator_ids),
        )

    def _apply(self, c: Any, event: object) -> None:
        # Each aggregate has its own view: look up only the row this event can change.
        ident = str(getattr(event, "originator_id", ""))
        if isinstance(event, AccessRefusal.Refused):
            row = project_refusal(None, event)
            if row is not None:
                self._write_refusal(c, ident, row)
        elif isinstance(event, IssuedToken.Minted | IssuedToken.Revoked):
            self._project(
                c, ident, event, ("tokens", "token_uuid"), project_token, self._write_token
            )
        elif isinstance(event, ApiKey.Created | ApiKey.Event):
            self._project(
                c, ident, event, ("api_keys", "key_id"), project_api_key, self._write_api_key
            )
        elif isinstance(event, Node.Event):
            self._project(c, ident, event, ("nodes", "node_id"), project_node, self._write_node)
        elif isinstance(event, RegisteredModel.Event):
            self._project(c, ident, event, ("models", "model_id"), project_model, self._write_model)
        elif isinstance(event, Job.Event):
            self._apply_job(c, ident, event)

    def _project(
        self,
        c: Any,
        ident: str,
        event: object,
        view: tuple[str, str],
        project: Callable[[dict[str, Any] | None, object], dict[str, Any] | None],
        write: Callable[[Any, str, dict[str, Any]], None],
    ) -> None:
        """``event`` applied to its aggregate's row of ``view`` (table, key column): the row
        projected from the stored one and written back (nothing when it does not change it)."""
        row = project(self._select_data(c, *view, ident), event)
        if row is not None:
            write(c, ident, row)

    def _write_node(self, c: Any, ident: str, node: dict[str, Any]) -> None:
        c.execute(
            self._sql(
                f"INSERT INTO {self._t('nodes')} (node_id, name, state, data) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET "
                "name = excluded.name, state = excluded.state, data = excluded.data"
            ),
            (ident, node["name"], node["state"], _dumps(node)),
        )
        eligible = eligibility_of(node)
        if eligible is None:
            c.execute(
                self._sql(f"DELETE FROM {self._t('eligibility')} WHERE node_id = ?"), (ident,)
            )
        else:
            c.execute(
                self._sql(
                    f"INSERT INTO {self._t('eligibility')} "
                    "(node_id, fallback_only, free_memory_bytes, data) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (node_id) DO UPDATE SET fallback_only = "
                    "excluded.fallback_only, free_memory_bytes = excluded.free_memory_bytes, "
                    "data = excluded.data"
                ),
                (
                    ident,
                    int(eligible["fallback_only"]),
                    eligible["free_memory_bytes"],
                    _dumps(eligible),
                ),
            )

    def _write_refusal(self, c: Any, ident: str, refusal: dict[str, Any]) -> None:
        c.execute(
            self._sql(
                f"INSERT INTO {self._t('refusals')} (refusal_id, node_id, node_name, at, data) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (refusal_id) DO NOTHING"
            ),
            (ident, refusal["node_id"], refusal["node_name"], refusal["at"], _dumps(refusal)),
        )

    def _write_token(self, c: Any, ident: str, token: dict[str, Any]) -> None:
        self._upsert(c, "tokens", ("token_uuid", "minted_at"), (ident, token["minted_at"]), token)

    def _upsert(
        self,
        c: Any,
        table: str,
        columns: tuple[str, str],
        values: tuple[str, Any],
        row: dict[str, Any],
    ) -> None:
        """Writes ``row`` as ``table``'s ``data`` where its key column (the first of
        ``columns``) and the other have ``values``; a row already there gets the new data."""
        key, other = columns
        c.execute(
            self._sql(
                f"INSERT INTO {self._t(table)} ({key}, {other}, data) VALUES (?, ?, ?) "
                f"ON CONFLICT ({key}) DO UPDATE SET data = excluded.data"
            ),
            (*values, _dumps(row)),
        )

    def _write_api_key(self, c: Any, ident: str, key: dict[str, Any]) -> None:
        self._upsert(c, "api_keys", ("key_id", "created_at"), (ident, key["created_at"]), key)

    def list_api_keys(self) -> list[dict[str, Any]]:
        """Managed inference keys, newest first."""
        return self._all(f"SELECT data FROM {self._t('api_keys')} ORDER BY created_at DESC, key_id")

    def get_api_key(self, key_id: str) -> dict[str, Any] | None:
        rows = self._all(f"SELECT data FROM {self._t('api_keys')} WHERE key_id = ?", (key_id,))
        return rows[0] if rows else None

    def list_tokens(self, limit: int = 100) -> list[dict[str, Any]]:
        """Enrollment tokens minted through dacp, newest first."""
        return self._all(
            f"SELECT data FROM {self._t('tokens')} "
            f"ORDER BY minted_at DESC, token_uuid LIMIT {int(limit)}"
        )

    def list_refusals(
        self, *, node_id: str | None = None, node_name: str | None = None, limit: int = 50
    ) -> list[dict[str, Any]]:
        """Refused enrollments and streams, newest first (of one node id or name if given)."""
        where, params = [], []
        if node_id is not None:
            where.append("node_id = ?")
            params.append(node_id)
        if node_name is not None:
            where.append("node_name = ?")
            params.append(node_name)
        return self._select_where(
            "refusals", where, " OR ", params, f"at DESC, refusal_id LIMIT {int(limit)}"
        )

    def _select_where(
        self, table: str, where: list[str], joiner: str, params: list[Any], order: str
    ) -> list[dict[str, Any]]:
        """The ``data`` of ``table``'s rows that meet the ``where`` conditions joined by
        ``joiner`` (all rows when there are none), ordered (and limited) by ``order``."""
        clause = f" WHERE {joiner.join(where)}" if where else ""
        return self._all(
            f"SELECT data FROM {self._t(table)}{clause} ORDER BY {order}", tuple(params)
        )

    def _write_model(self, c: Any, ident: str, model: dict[str, Any]) -> None:
        self._upsert(c, "models", ("model_id", "name"), (ident, model["name"]), model)

    def _apply_job(self, c: Any, ident: str, event: object) -> None:
        job_row = self._select_data(c, "jobs", "job_id", ident)
        job = project_job(job_row, event)
        if job is None:
            return
        self._write_job(c, ident, job, job_row)

    def _write_job(
        self, c: Any, ident: str, job: dict[str, Any], job_row: dict[str, Any] | None
    ) -> None:
        self._write_jobs(c, [(ident, job, job_row)])

    def _write_jobs(
        self, c: Any, jobs: list[tuple[str, dict[str, Any], dict[str, Any] | None]]
    ) -> None:
        """Upserts job rows in one statement run for all (``executemany``)."""
        if not jobs:
            return
        c.executemany(
            self._sql(
                f"INSERT INTO {self._t('jobs')} (job_id, state, model, submitted_at, data, "
                "key_id, ended_at, prompt_tokens, completion_tokens) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id) DO UPDATE SET "
                "state = excluded.state, data = excluded.data, key_id = excluded.key_id, "
                "ended_at = excluded.ended_at, prompt_tokens = excluded.prompt_tokens, "
                "completion_tokens = excluded.completion_tokens"
            ),
            [
                (
                    ident,
                    job["state"],
                    job["model"],
                    job["submitted_at"],
                    _dumps(job),
                    job.get("key_id") or "",
                    job.get("ended_at"),
                    job.get("prompt_tokens"),
                    job.get("completion_tokens"),
                )
                for ident, job, _ in jobs
            ],
        )
        for ident, job, job_row in jobs:
            self._write_job_nodes(c, ident, job, job_row)

    def _write_job_nodes(
        self, c: Any, ident: str, job: dict[str, Any], job_row: dict[str, Any] | None
    ) -> None:
        if job_row is None or job_row["nodes"] != job["nodes"]:
            c.execute(self._sql(f"DELETE FROM {self._t('job_nodes')} WHERE job_id = ?"), (ident,))
            for node_id in job["nodes"]:
                c.execute(
                    self._sql(
                        f"INSERT INTO {self._t('job_nodes')} (job_id, node_id) VALUES (?, ?)"
                    ),
                    (ident, node_id),
                )

    def _select_data(self, c: Any, table: str, key: str, ident: str) -> dict[str, Any] | None:
        c.execute(self._sql(f"SELECT data FROM {self._t(table)} WHERE {key} = ?"), (ident,))
        row = c.fetchone()
        return cast(dict[str, Any], _loads(row["data"])) if row is not None else None

    def _select(self, c: Any, table: str, ident: str) -> dict[str, Any] | None:
        return self._select_data(c, table, _KEYS[table], ident)

    def _select_many(self, c: Any, table: str, idents: list[str]) -> dict[str, dict[str, Any]]:
        key = _KEYS[table]
        out: dict[str, dict[str, Any]] = {}
        if self.ph == "%s":  # Postgres: one statement whatever the count (prepared once)
            c.execute(f"SELECT {key}, data FROM {self._t(table)} WHERE {key} = ANY(%s)", (idents,))
            for row in c.fetchall():
                out[str(row[key])] = cast(dict[str, Any], _loads(row["data"]))
            return out
        for start in range(0, len(idents), 500):
            chunk = idents[start : start + 500]
            marks = ", ".join("?" * len(chunk))
            c.execute(
                self._sql(f"SELECT {key}, data FROM {self._t(table)} WHERE {key} IN ({marks})"),
                tuple(chunk),
            )
            for row in c.fetchall():
                out[str(row[key])] = cast(dict[str, Any], _loads(row["data"]))
        return out

    def clear(self) -> None:
        """Empties the views and forgets the tracked position (for a rebuild)."""
        with self._transaction(commit=True) as c:
            for table in VIEW_TABLES:
                c.execute(f"DELETE FROM {self._t(table)}")
            c.execute(
                self._sql(f"DELETE FROM {self.tracking_table()} WHERE application_name = ?"),
                (self.view_name,),
            )

    def tracking_table(self) -> str:
        raise NotImplementedError

    # ----------------------------------------------------------------- queries

    def _all(self, statement: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._transaction(commit=False) as c:
            c.execute(self._sql(statement), params)
            return [cast(dict[str, Any], _loads(r["data"])) for r in c.fetchall()]

    def get_node(self, node_id: str) -> dict[str, Any] | None:
        rows = self._all(f"SELECT data FROM {self._t('nodes')} WHERE node_id = ?", (node_id,))
        return rows[0] if rows else None

    def list_nodes(self) -> list[dict[str, Any]]:
        return self._all(f"SELECT data FROM {self._t('nodes')} ORDER BY name, node_id")

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        rows = self._all(f"SELECT data FROM {self._t('jobs')} WHERE job_id = ?", (job_id,))
        return rows[0] if rows else None

    def list_jobs(
        self,
        *,
        state: str | None = None,
        model: str | None = None,
        node_id: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        where, params = [], []
        if state:
            where.append("state = ?")
            params.append(state)
        if model:
            where.append("model = ?")
            params.append(model)
        if node_id:
            where.append(f"job_id IN (SELECT job_id FROM {self._t('job_nodes')} WHERE node_id = ?)")
            params.append(node_id)
        return self._select_where(
            "jobs",
            where,
            " AND ",
            params,
            f"submitted_at DESC, job_id LIMIT {int(limit)} OFFSET {int(offset)}",
        )

    def job_ids_starting(self, prefix: str, limit: int = 10) -> list[str]:
        if not re.fullmatch(r"[0-9a-f-]*", prefix):
            return []  # nothing else begins an id (and LIKE's wildcards stay out)
        return [
            row["job_id"]
            for row in self._all(
                f"SELECT data FROM {self._t('jobs')} WHERE job_id LIKE ? "
                f"ORDER BY job_id LIMIT {int(limit)}",
                (prefix + "%",),
            )
        ]

    def usage(self, query: UsageQuery) -> list[dict[str, Any]]:
        """Ended jobs summed by ``query.group_by`` (:class:`application.ports.UsageReader`)."""
        where, params = ["ended_at IS NOT NULL"], []
        for condition, value in (
            ("key_id = ?", query.key_id),
            ("model = ?", query.model),
            ("ended_at >= ?", _stamp(query.start)),
            ("ended_at < ?", _stamp(query.end)),
        ):
            if value is not None:
                where.append(condition)
                params.append(value)
        groups = [_USAGE_GROUPS[g] for g in ("day", "key", "model") if g in query.group_by]
        chosen = "".join(f"{expression} AS {alias}, " for expression, alias in groups)
        grouped = ", ".join(expression for expression, _ in groups)
        tail = f" GROUP BY {grouped} ORDER BY {grouped}" if groups else ""
        statement = (
            f"SELECT {chosen}COUNT(*) AS requests, "
            "CAST(COALESCE(SUM(prompt_tokens), 0) AS BIGINT) AS prompt_tokens, "
            "CAST(COALESCE(SUM(completion_tokens), 0) AS BIGINT) AS completion_tokens "
            f"FROM {self._t('jobs')} WHERE {' AND '.join(where)}{tail}"
        )
        with self._transaction(commit=False) as c:
            c.execute(self._sql(statement), tuple(params))
            rows = [dict(row) for row in c.fetchall()]
        return [row for row in rows if row["requests"]]

    def key_names(self) -> dict[str, str]:
        """The managed keys' names by key id (:class:`application.ports.UsageReader`): none
        in views that have no ``api_keys`` table."""
        with self._transaction(commit=False) as c:
            if not self._has_table(c, "api_keys"):
                return {}
            c.execute(f"SELECT key_id, data FROM {self._t('api_keys')}")
            rows = c.fetchall()
        names = {str(row["key_id"]): (_loads(row["data"]) or {}).get("name") for row in rows}
        return {key: str(name) for key, name in names.items() if name}

    def eligibility(self) -> list[dict[str, Any]]:
        return self._all(
            f"SELECT data FROM {self._t('eligibility')} "
            "ORDER BY fallback_only, free_memory_bytes DESC, node_id"
        )

    def get_model(self, name: str) -> dict[str, Any] | None:
        rows = self._all(f"SELECT data FROM {self._t('models')} WHERE name = ?", (name,))
        return rows[0] if rows else None

    def list_models(self) -> list[dict[str, Any]]:
        return self._all(f"SELECT data FROM {self._t('models')} ORDER BY name")

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        """Every row of every view, in a stable order (rebuild comparisons)."""
        out: dict[str, list[dict[str, Any]]] = {
            "nodes": self._all(f"SELECT data FROM {self._t('nodes')} ORDER BY node_id"),
            "eligibility": self._all(f"SELECT data FROM {self._t('eligibility')} ORDER BY node_id"),
            "jobs": self._all(f"SELECT data FROM {self._t('jobs')} ORDER BY job_id"),
            "models": self._all(f"SELECT data FROM {self._t('models')} ORDER BY name"),
        }
        with self._transaction(commit=False) as c:
            c.execute(
                f"SELECT job_id, node_id FROM {self._t('job_nodes')} ORDER BY job_id, node_id"
            )
            out["job_nodes"] = [
                {"job_id": r["job_id"], "node_id": r["node_id"]} for r in c.fetchall()
            ]
        return out


class SQLiteReadModel(_ReadModelViews, SQLiteTrackingRecorder):
    ph = "?"

    def construct_create_table_statements(self) -> list[str]:
        return [*super().construct_create_table_statements(), *self.view_statements()]

    def create_table(self) -> None:
        super().create_table()
        self.migrate_views()

    def tracking_table(self) -> str:
        return "tracking"


class PostgresReadModel(_ReadModelViews, PostgresTrackingRecorder):
    ph = "%s"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sql_create_statements.extend(SQL(s).format() for s in self.view_statements())  # type: ignore[arg-type]

    def _t(self, table: str) -> str:
        return f'"{self.datastore.schema}"."{self.view_name}_{table}"'

    def create_table(self) -> None:
        super().create_table()
        self.migrate_views()

    _add = "IF NOT EXISTS"

    def _columns(self, c: Any, table: str) -> set[str]:
        c.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = %s AND table_name = %s",
            (self.datastore.schema, f"{self.view_name}_{table}"),
        )
        return {str(row["column_name"]) for row in c.fetchall()}

    def _json_field(self, name: str, *, number: bool = False) -> str:
        text = f"(data::jsonb ->> '{name}')"
        return f"{text}::bigint" if number else text

    def _has_table(self, c: Any, table: str) -> bool:
        c.execute("SELECT to_regclass(%s) IS NOT NULL AS there", (self._t(table),))
        row = c.fetchone()
        return bool(row and row["there"])

    def tracking_table(self) -> str:
        return f'"{self.datastore.schema}"."{self.tracking_table_name}"'


ReadModelStore = SQLiteReadModel | PostgresReadModel


def _stamp(moment: dt.datetime | None) -> str | None:
    """A moment as the views store times (events' ISO 8601 in UTC), for comparing with them."""
    return moment.astimezone(dt.UTC).isoformat() if moment is not None else None


def open_read_model(env: Mapping[str, str], view_name: str = "dacp_readmodel") -> ReadModelStore:
    """Opens (creating on first use) the views named ``view_name`` in the store of ``env``."""
    environment = Environment(name=view_name, env=dict(env))
    factory = InfrastructureFactory.construct(environment)
    is_pg = environment.get("PERSISTENCE_MODULE") == "eventsourcing.postgres"
    cls: type[ReadModelStore] = PostgresReadModel if is_pg else SQLiteReadModel
    # The view name must be known before the recorder builds its CREATE statements.
    view_cls = type(cls.__name__, (cls,), {"view_name": view_name})
    store = factory.tracking_recorder(view_cls)  # type: ignore[arg-type]
    cast(Any, store).factory = factory  # keeps the connection pool alive with the store
    return cast(ReadModelStore, store)
