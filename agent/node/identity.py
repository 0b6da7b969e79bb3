"""The node's persisted identity: ``<data_dir>/identity.json``.

Written once after a successful ``Enroll`` and read on every start, so a restarted agent
reconnects as the same node instead of enrolling again. The file holds the per-node
credential, so it is written atomically (temp file in the same directory + ``os.replace``)
with mode 0600 on POSIX systems; on Windows the file inherits the ACL of the user's data dir.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

IDENTITY_FILE_NAME = "identity.json"
_FIELDS = ("node_id", "node_credential", "controller_url", "node_name", "enrolled_at")
_OPTIONAL_FIELDS = ("controller_ca_pem", "tls_server_name")


class IdentityFileError(ValueError):
    """identity.json exists but cannot be read or is not a valid identity."""


@dataclass(frozen=True)
class NodeIdentity:
    node_id: str
    node_credential: str
    controller_url: str
    node_name: str
    enrolled_at: str  # ISO 8601, UTC
    #: The controller's CA pinned at enrollment (PEM) and the name its certificate is
    #: verified under; empty for a controller reached in plaintext or through system roots.
    #: The name is ``common.contract.CONTROLLER_TLS_NAME`` or the controller URL's host (see
    #: ``agent.control.controller_tls.controller_names``); any other (identities saved before the
    #: agent checked it held a name read from the presented certificate) is verified again.
    controller_ca_pem: str = ""
    tls_server_name: str = ""

    def __repr__(self) -> str:  # never print the credential
        return (
            f"NodeIdentity(node_id={self.node_id!r}, node_credential='***', "
            f"controller_url={self.controller_url!r}, node_name={self.node_name!r}, "
            f"enrolled_at={self.enrolled_at!r})"
        )

    __str__ = __repr__

    @classmethod
    def new(
        cls,
        node_id: str,
        node_credential: str,
        controller_url: str,
        node_name: str,
        controller_ca_pem: str = "",
        tls_server_name: str = "",
    ) -> NodeIdentity:
        """An identity enrolled now."""
        enrolled_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        return cls(
            node_id,
            node_credential,
            controller_url,
            node_name,
            enrolled_at,
            controller_ca_pem,
            tls_server_name,
        )

    def with_controller_url(self, controller_url: str) -> NodeIdentity:
        return dataclasses.replace(self, controller_url=controller_url)


def identity_path(data_dir: Path | str) -> Path:
    return Path(data_dir).expanduser() / IDENTITY_FILE_NAME


def _parse(raw: Any, path: Path) -> NodeIdentity:
    if not isinstance(raw, dict):
        raise IdentityFileError(f"{path}: expected a JSON object")
    values: dict[str, str] = {}
    for name in _FIELDS:
        value = raw.get(name)
        if not isinstance(value, str):
            raise IdentityFileError(f"{path}: field {name!r} is missing or not a string")
        values[name] = value
    for name in _OPTIONAL_FIELDS:
        value = raw.get(name, "")
        if not isinstance(value, str):
            raise IdentityFileError(f"{path}: field {name!r} is not a string")
        values[name] = value
    if not values["node_id"] or not values["node_credential"]:
        raise IdentityFileError(f"{path}: node_id and node_credential must not be empty")
    return NodeIdentity(**values)


def load_identity(data_dir: Path | str) -> NodeIdentity | None:
    """The stored identity, or None when the agent has not enrolled yet.

    Raises :class:`IdentityFileError` when the file exists but is unusable: silently
    enrolling again would orphan the old node (and single-use tokens would fail anyway).
    """
    path = identity_path(data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise IdentityFileError(f"cannot read {path}: {exc}") from exc
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise IdentityFileError(f"{path} is not valid JSON: {exc}") from exc
    identity = _parse(raw, path)
    _warn_if_exposed(path)
    return identity


def save_identity(data_dir: Path | str, identity: NodeIdentity) -> Path:
    """Write identity.json atomically; mode 0600 where the OS supports POSIX permissions."""
    path = identity_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    payload = json.dumps(asdict(identity), indent=2, sort_keys=True) + "\n"
    # mkstemp creates the file readable by the owner only (0600) on POSIX.
    fd, tmp_name = tempfile.mkstemp(prefix=".identity-", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        _restrict(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _restrict(path)
    return path


def delete_identity(data_dir: Path | str) -> bool:
    """Remove identity.json; True if there was one."""
    path = identity_path(data_dir)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _restrict(path: Path) -> None:
    if os.name != "posix":  # Windows: chmod only toggles read-only; rely on the dir's ACL
        return
    with contextlib.suppress(OSError):
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def _warn_if_exposed(path: Path) -> None:
    if os.name != "posix":
        return
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "%s is accessible by other users (mode %o); it holds the node credential — "
            "run: chmod 600 %s",
            path,
            stat.S_IMODE(mode),
            path,
        )
