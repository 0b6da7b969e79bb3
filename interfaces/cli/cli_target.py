"""Which controller or event store a ``dacp`` command uses, and saying so.

Every command reads its settings as the controller does (the environment over the config file,
:mod:`infrastructure.config_file`). Commands that change the cluster (tokens, models, nodes) go
through the running controller's admin API at ``DACP_URL`` (which ``dacp controller`` writes
into the config file at its first start), as ``kubectl`` does; they write to the event store
directly only with ``--store``. Each command that succeeds ends with a line on stderr naming the
controller or the store it used, so a second shell never silently uses another cluster (a
failing one prints its one error line, which names the controller or store it could not use).
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from infrastructure.config_file import URL_ENV, Configuration, load_configuration
from infrastructure.settings import Settings

if TYPE_CHECKING:
    from application.controller import Controller


class CliError(Exception):
    """A one-line message for the user; exit code 2."""


#: What the running command used (a controller, a store), said once it has succeeded: an error
#: stays one line.
_used: list[str] = []


def take_used() -> list[str]:
    """The lines naming what the command used, once each."""
    lines = list(dict.fromkeys(_used))
    _used.clear()
    return lines


def _masked(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    user = parts.username or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class CliEnv:
    """One command's settings and where they came from."""

    configuration: Configuration
    environ: Mapping[str, str]

    @property
    def values(self) -> dict[str, str]:
        return self.configuration.values

    def settings(self) -> Settings:
        return Settings.from_env(self.values)

    def _from(self, key: str) -> str:
        origin = self.configuration.origin(key, self.environ)
        return "the default" if origin == "default" else origin

    def store_label(self, database_url: str | None = None) -> str:
        """The event store this command opens, and where that choice came from."""
        if database_url:
            return f"{_masked(database_url)} (--database-url)"
        url = self.values.get("DATABASE_URL", "")
        if url:
            return f"{_masked(url)} (DATABASE_URL from {self._from('DATABASE_URL')})"
        var_dir = self.settings().var_dir
        return f"SQLite in {var_dir} (DACP_VAR_DIR from {self._from('DACP_VAR_DIR')})"

    def controller_url(self) -> str | None:
        return self.values.get(URL_ENV, "").strip().rstrip("/") or None

    def say(self, line: str) -> None:
        """One line on stderr, now."""
        print(f"dacp: {line}", file=sys.stderr)

    def using_store(self, database_url: str | None = None) -> None:
        _used.append(f"used the event store {self.store_label(database_url)}")

    def admin(self, url: str | None = None) -> AdminClient:
        """The admin API of the controller at ``url`` (default ``DACP_URL``), announced."""
        target = (url or self.controller_url() or "").rstrip("/")
        if not target:
            raise CliError(
                f"no controller is configured: set {URL_ENV}, or start `dacp controller` once "
                f"(it writes {URL_ENV} into {self.configuration.path})"
            )
        _used.append(f"used the controller at {target} ({URL_ENV} from {self._from(URL_ENV)})")
        return AdminClient(target, self.values.get("ADMIN_API_KEY", ""), self._verify(target))

    def _verify(self, url: str) -> ssl.SSLContext | bool:
        """What HTTPS trusts: SSL_CERT_FILE (else the system's CAs), and the controller's own
        CA when it is on this machine (read, never created)."""
        if not url.startswith("https:"):
            return True
        from infrastructure.tls import ca_path

        context = ssl.create_default_context(cafile=self.values.get("SSL_CERT_FILE") or None)
        settings = self.settings()
        for ca in (settings.tls_ca_file, ca_path(settings.tls_dir)):
            if ca is not None and ca.is_file():
                context.load_verify_locations(cafile=str(ca))
        return context


def load_cli_env(environ: Mapping[str, str] | None = None) -> CliEnv:
    environ = os.environ if environ is None else environ
    return CliEnv(load_configuration(environ), environ)


def open_app(args: argparse.Namespace, env: CliEnv | None = None) -> Controller:
    """The event store's application, as the configuration names it (said on stderr)."""
    from application.controller import Controller
    from infrastructure.persistence import persistence_env
    from infrastructure.storage import ensure_postgres_schema

    env = env or load_cli_env()
    settings = env.settings()
    given = getattr(args, "database_url", None)
    env.using_store(given)
    store = persistence_env(given or settings.database_url, var_dir=settings.var_dir)
    ensure_postgres_schema(store)
    return Controller(env=store)


def store_flag(command: argparse.ArgumentParser) -> None:
    """``--store``: write to the event store directly instead of the running controller."""
    command.add_argument(
        "--store",
        action="store_true",
        help=f"write to the event store directly (no controller running) instead of through "
        f"the controller's admin API at {URL_ENV}",
    )


@dataclass(frozen=True)
class AdminClient:
    """The running controller's admin API (``ADMIN_API_KEY``)."""

    url: str
    key: str
    verify: ssl.SSLContext | bool

    def call(self, method: str, path: str, body: dict[str, Any] | None, expected: int) -> Any:
        """The answer's JSON; a :class:`CliError` with the controller's message otherwise."""
        import httpx

        try:
            answer = httpx.request(
                method,
                f"{self.url}{path}",
                headers={"Authorization": f"Bearer {self.key}"},
                json=body,
                timeout=60,
                verify=self.verify,
            )
        except httpx.HTTPError as e:
            raise CliError(
                f"cannot reach the controller at {self.url}: {e} (is it running? --store writes "
                "to its event store directly)"
            ) from e
        if answer.status_code != expected:
            try:
                message = answer.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text[:200]
            raise CliError(f"refused ({answer.status_code}): {message}")
        return answer.json()
