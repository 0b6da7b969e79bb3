"""Event-store selection: ``DATABASE_URL=postgresql://…`` → Postgres, else embedded SQLite.

The URL is mapped onto eventsourcing's own settings (``POSTGRES_*`` / ``SQLITE_*``), so the
library does all the storing; tables are created on first start.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from infrastructure.settings import SettingsError

DEFAULT_SQLITE_FILE = "dacp.sqlite3"
#: The longest a command waits for a pooled PostgreSQL connection (see persistence_env).
POOL_WAIT_SECONDS = 2


def is_postgres(database_url: str | None) -> bool:
    return bool(database_url) and urlparse(database_url or "").scheme in (
        "postgres",
        "postgresql",
        "postgresql+psycopg",
    )


#: The event store's JSON, written and read with orjson (``infrastructure/orjson_transcoder``).
TRANSCODER_TOPIC = "infrastructure.orjson_transcoder:OrjsonTranscoder"


def persistence_env(
    database_url: str | None,
    *,
    var_dir: Path = Path("var"),
    pool_size: int = 5,
    schema: str | None = None,
) -> dict[str, str]:
    """The eventsourcing environment for a ``DATABASE_URL`` (``None`` → SQLite in var/)."""
    if not database_url:
        var_dir.mkdir(parents=True, exist_ok=True)
        return _sqlite_env(str(var_dir / DEFAULT_SQLITE_FILE))
    url = urlparse(database_url)
    if url.scheme == "sqlite":
        # sqlite:///relative/path or sqlite:////absolute/path
        path = unquote(url.path[1:] if url.path.startswith("/") else url.path)
        if not path:
            raise SettingsError("DATABASE_URL sqlite:/// needs a file path")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return _sqlite_env(path)
    if not is_postgres(database_url):
        raise SettingsError(
            f"DATABASE_URL scheme {url.scheme!r} is not supported (use postgresql:// or sqlite:///)"
        )
    dbname = unquote(url.path.lstrip("/"))
    if not dbname:
        raise SettingsError("DATABASE_URL must name a database, e.g. postgresql://host/dbname")
    query = parse_qs(url.query)
    env = {
        "PERSISTENCE_MODULE": "eventsourcing.postgres",
        "POSTGRES_DBNAME": dbname,
        "POSTGRES_HOST": url.hostname or "127.0.0.1",
        "POSTGRES_PORT": str(url.port or 5432),
        "POSTGRES_USER": unquote(url.username or "postgres"),
        "POSTGRES_PASSWORD": unquote(url.password or ""),
        "POSTGRES_POOL_SIZE": str(pool_size),
        "POSTGRES_MAX_OVERFLOW": str(pool_size),
        # How long a command waits for a pooled connection (eventsourcing's name for the
        # pool's timeout). Commands run on DATABASE_POOL_SIZE * 2 + 2 threads against up to
        # DATABASE_POOL_SIZE * 2 connections, so under load a wait lasts one command (ms),
        # and a wait this long means the store is unreachable: the first command after an
        # outage the store guard has not seen yet fails within it, not within 10 s.
        "POSTGRES_CONNECT_TIMEOUT": str(POOL_WAIT_SECONDS),
        "POSTGRES_PRE_PING": "y",
        "POSTGRES_LOCK_TIMEOUT": "5",
        "CREATE_TABLE": "y",
        "TRANSCODER_TOPIC": TRANSCODER_TOPIC,
    }
    chosen_schema = schema or (query.get("schema") or [""])[0]
    if chosen_schema:
        env["POSTGRES_SCHEMA"] = chosen_schema
    return env


def _sqlite_env(path: str) -> dict[str, str]:
    return {
        "PERSISTENCE_MODULE": "eventsourcing.sqlite",
        "SQLITE_DBNAME": path,
        "SQLITE_LOCK_TIMEOUT": "10",
        "CREATE_TABLE": "y",
        "TRANSCODER_TOPIC": TRANSCODER_TOPIC,
    }
