"""The cluster's configuration file: where it is, what it says, and writing it at a controller's
first start.

The controller and every ``dacp`` command find their settings the same way: the environment,
then this one file (the environment wins, key by key). Its keys are the environment variables
of the configuration table in docs/reference.md (``DATABASE_URL = "postgresql://…"``), plus
``DACP_URL``, the controller's HTTP address, which the CLI talks to. Nothing depends on the current
directory.

Where it is: ``DACP_CONFIG`` if set; else ``$XDG_CONFIG_HOME/dacp/config.toml`` (default
``~/.config/dacp/config.toml``) if it exists; else ``/etc/dacp/config.toml`` (a system install)
if that exists; else the user path, where ``dacp controller`` writes it at its first start.
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infrastructure.settings import SETTING_NAMES, SettingsError

#: The variable naming the file explicitly.
CONFIG_ENV = "DACP_CONFIG"
#: The controller's HTTP address, for the CLI (a key of the file, or the environment).
URL_ENV = "DACP_URL"
SYSTEM_CONFIG = Path("/etc/dacp/config.toml")
#: Every key the file may hold.
CONFIG_KEYS = frozenset((*SETTING_NAMES, URL_ENV))
#: What a first start writes, in this order (when set).
FIRST_START_KEYS = (
    URL_ENV,
    "DACP_VAR_DIR",
    "DATABASE_URL",
    "REDIS_URL",
    "HOST",
    "PORT",
    "GRPC_HOST",
    "GRPC_PORT",
    "GRPC_INSECURE",
    "MODEL_STORE_DIR",
    "MODEL_STORE_PORT",
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "TLS_CA_FILE",
    "ADMIN_API_KEY",
    "NODE_ENROLLMENT_SECRET",
    "AI_API_KEY",
)


def user_config_path(environ: Mapping[str, str]) -> Path:
    xdg = environ.get("XDG_CONFIG_HOME", "").strip()
    root = Path(xdg) if xdg else Path(environ.get("HOME") or Path.home()) / ".config"
    return root / "dacp" / "config.toml"


def config_path(environ: Mapping[str, str], system: Path = SYSTEM_CONFIG) -> Path:
    """The file this environment's commands read (it may not exist yet)."""
    named = environ.get(CONFIG_ENV, "").strip()
    if named:
        return Path(named).expanduser()
    user = user_config_path(environ)
    if not user.exists() and system.exists():
        return system
    return user


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def read_config(path: Path) -> dict[str, str]:
    """The file's settings as environment strings; a :class:`SettingsError` naming the file for
    a file that is not TOML or holds a key no setting has."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path} is not valid TOML: {e}") from None
    except OSError as e:
        raise SettingsError(f"cannot read {path}: {e.strerror or e}") from None
    values: dict[str, str] = {}
    for key, value in data.items():
        if key not in CONFIG_KEYS:
            close = difflib.get_close_matches(key.upper(), sorted(CONFIG_KEYS), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SettingsError(f"{path}: {key!r} is not a setting{hint}")
        if not isinstance(value, str | int | float | bool):
            raise SettingsError(f"{path}: {key} must be a string, number or boolean")
        values[key] = _text(value)
    return values


@dataclass(frozen=True)
class Configuration:
    """The environment a command runs with: the file's values under the environment's."""

    values: dict[str, str]
    #: The file these values were read from; None when there was none.
    file: Path | None
    #: Where the file is or would be.
    path: Path

    def origin(self, key: str, environ: Mapping[str, str]) -> str:
        """Where ``key``'s value comes from, for the line naming what a command used."""
        if key in environ and environ[key] != "":
            return "environment"
        if self.file is not None and key in self.values:
            return str(self.file)
        return "default"


def load_configuration(environ: Mapping[str, str] | None = None) -> Configuration:
    environ = os.environ if environ is None else environ
    path = config_path(environ)
    from_file = read_config(path) if path.is_file() else {}
    set_here = {k: v for k, v in environ.items() if v != "" or k not in from_file}
    return Configuration({**from_file, **set_here}, path if path.is_file() else None, path)


def render(values: Mapping[str, str], now: dt.datetime) -> str:
    """The file's text: a header saying what it is, then one ``KEY = "value"`` per line (a
    JSON string is a TOML basic string)."""
    lines = [
        f"# dacp's configuration, written by `dacp controller` at its first start "
        f"({now.strftime('%Y-%m-%dT%H:%M:%SZ')}).",
        "# The controller and every dacp command read it; the environment overrides any key.",
        "# Keys are the environment variables of docs/reference.md's configuration table.",
        "# Keep it private (mode 0600): it holds the admin key and the enrollment secret.",
    ]
    lines += [f"{key} = {json.dumps(values[key])}" for key in values]
    return "\n".join(lines) + "\n"


def write_new(path: Path, values: Mapping[str, str], now: dt.datetime) -> bool:
    """Writes the file (mode 0600) unless it exists; whether it wrote it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(render(values, now))
    return True
