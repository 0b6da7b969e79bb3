"""The node agent's configuration and its fatal errors: the controller URL, the agent's settings
(flags and environment, see ``agent/main.py``), retry backoff, and the errors the CLI prints as
one line."""

from __future__ import annotations

import ipaddress
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import grpc.aio

from agent.models.fetch_limits import FetchLimits
from agent.runtime.job_messages import TOKEN_BATCH_SECONDS
from agent.runtime.server_spec import DEFAULT_POLL
from common.contract import (
    DEFAULT_ALLOWED_PEER_CIDRS,
    DEFAULT_GRPC_PORT,
    DEFAULT_RPC_PORT,
    MEMORY_LIMIT_LABEL,
    SLOTS_LABEL,
    TRANSFER_PORT_LABEL,
)
from wire import keepalive

log = logging.getLogger(__name__)

#: Most jobs a node runs at once as a primary: llama-server slots (``--parallel``). The
#: controller gives a server as many slots as the nodes' memory holds, up to this cap.
DEFAULT_SLOTS = 4
DEFAULT_HEARTBEAT_INTERVAL = 5.0
#: How long a stopping agent (its first SIGINT/SIGTERM) lets its running jobs finish before it
#: stops with them (s): ``--drain-timeout``, env DACP_DRAIN_TIMEOUT; 0 stops it at once.
DEFAULT_DRAIN_TIMEOUT = 60.0
# Inventory labels the agent sets itself (SLOTS_LABEL, MEMORY_LIMIT_LABEL: see proto).
RESERVED_LABELS = frozenset({SLOTS_LABEL, MEMORY_LIMIT_LABEL, TRANSFER_PORT_LABEL})

Jitter = Callable[[float, float], float]

# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class AgentError(Exception):
    """A fatal agent problem; the CLI prints it as one line and exits with code 2."""


class ConfigError(AgentError, ValueError):
    """Bad agent configuration (controller URL, flags, missing token...)."""


class MissingEnrollmentToken(ConfigError):
    """No stored identity and no enrollment token to get one."""


class EnrollmentRefused(AgentError):
    """The controller refused the enrollment token (or the inventory it came with)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"enrollment refused by the controller ({code.name}): {details}")


class IdentityRejected(AgentError):
    """The controller does not accept the stored node identity."""

    def __init__(self, node_id: str, details: str, path: Path) -> None:
        self.node_id = node_id
        self.details = details
        super().__init__(
            f"controller rejected the stored identity of node {node_id} (UNAUTHENTICATED: "
            f"{details}); if this node was removed or the controller reset, delete {path} "
            "and enroll again with a new token"
        )


# ---------------------------------------------------------------------------
# Controller URL
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ControllerTarget:
    address: str  # "host:port" as gRPC dials it ("[v6]:port" for IPv6)
    secure: bool
    url: str  # as the operator wrote it, for messages
    host: str = ""
    port: int = 0


def parse_controller_url(url: str, *, insecure: bool = False) -> ControllerTarget:
    """Accept ``host:port`` and ``grpcs://host:port`` (TLS), and ``grpc://host:port``
    (plaintext, only with ``insecure``); ``host:port`` is plaintext too with ``insecure``.

    The port defaults to ``common.contract.DEFAULT_GRPC_PORT``. Raises :class:`ConfigError` for
    anything else.
    """
    text = url.strip()
    if not text:
        raise ConfigError("controller URL is empty")
    candidate = text if "://" in text else f"{'grpc' if insecure else 'grpcs'}://{text}"
    parts = urlsplit(candidate)
    scheme = parts.scheme.lower()
    if scheme not in ("grpc", "grpcs"):
        raise ConfigError(
            f"unsupported controller URL scheme {parts.scheme!r} in {url!r}; "
            "use host:port, grpc://host:port or grpcs://host:port"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(f"controller URL {url!r} must be just scheme://host:port")
    try:
        host = parts.hostname
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid controller URL {url!r}: {exc}") from exc
    if not host:
        raise ConfigError(f"controller URL {url!r} has no host")
    if port is None:
        port = DEFAULT_GRPC_PORT
    if port == 0:
        raise ConfigError(f"controller URL {url!r} has port 0")
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    address = f"[{host}]:{port}" if is_v6 else f"{host}:{port}"
    if scheme == "grpc" and not insecure:
        raise ConfigError(
            f"{url!r} asks for a plaintext control channel: pass --insecure (or set "
            "GRPC_INSECURE=true) to allow it, or drop grpc:// to use TLS"
        )
    if scheme == "grpcs" and insecure:
        raise ConfigError(f"{url!r} asks for TLS, but --insecure asks for plaintext")
    return ControllerTarget(
        address=address, secure=scheme == "grpcs", url=text, host=host, port=port
    )


# ---------------------------------------------------------------------------
# Sizes (--memory-limit, --models-disk-limit)
# ---------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_byte_size(text: str) -> int:
    """``1073741824``, ``512M``, ``2G``, ``1.5GiB``, ``64kb``: K/M/G/T are powers of 1024."""
    match = _SIZE_PATTERN.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (use bytes or a K/M/G/T suffix, e.g. 2G)")
    value = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if value < 1:
        raise ValueError(f"size must be at least 1 byte: {text!r}")
    return value


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass
class AgentConfig:
    data_dir: Path
    node_name: str
    controller_url: str | None = None  # None: the URL stored in identity.json
    enrollment_token: str | None = None
    models_dir: Path | None = None  # None: <data_dir>/models
    advertise_address: str = "127.0.0.1"
    rpc_port: int = DEFAULT_RPC_PORT
    #: The model file server's port (the CLI's default is DEFAULT_TRANSFER_PORT; 0: none).
    transfer_port: int = 0
    #: Where the primaries that may reach this node's RPC worker can be (the controller names
    #: them; the agent checks its own list too).
    allowed_peer_cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS
    labels: dict[str, str] = field(default_factory=dict)
    slots: int = DEFAULT_SLOTS
    #: CPU threads of each llama.cpp process (``--threads``; None: llama.cpp's default).
    threads: int | None = None
    #: llama-server's ``--poll`` (agent/runtime/server_spec.py: DEFAULT_POLL).
    poll: int = DEFAULT_POLL
    #: The shortest time between two messages of one job's tokens (``--stream-interval``, s).
    stream_interval: float = TOKEN_BATCH_SECONDS
    llama_bin_dir: Path | None = None
    #: ``--llama-backend``: a backend name, or "" / "auto" for $LLAMA_BACKEND, else this
    #: machine's (agent/runtime/llama_backend.py); with ``llama_bin_dir``, that build's backend.
    llama_backend: str = ""
    heartbeat_interval: float | None = None  # None: the controller's (Welcome/EnrollResponse)
    #: How long the first stop signal lets running jobs finish (0: the agent stops at once).
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    tls_ca_file: Path | None = None
    #: A plaintext control channel (``--insecure``/GRPC_INSECURE=true); TLS otherwise.
    insecure: bool = False
    memory_limit_bytes: int | None = None  # None: no limit is reported
    #: The most the models directory's ``*.gguf`` and ``.partial`` files may hold (None: the
    #: disk is the limit); a fetch that would go beyond it is refused.
    models_disk_limit_bytes: int | None = None
    #: How long one source of a model file may take (``--fetch-deadline``,
    #: ``--fetch-min-rate``, ``--fetch-rate-window``): then the next source is tried.
    fetch_limits: FetchLimits = field(default_factory=FetchLimits)
    # build_handler() runs llama.cpp only when asked (the CLI does unless --no-runtime).
    llama_runtime: bool = False
    runtime_log_dir: Path | None = None  # None: <data_dir>/logs
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    resource_check_interval: float = 30.0
    rpc_timeout: float = 15.0  # Enroll deadline and how long to wait for Welcome
    # gRPC keepalive on the control channel (wire/keepalive.py): a dead link is noticed.
    keepalive_interval: float = keepalive.DEFAULT_INTERVAL
    keepalive_timeout: float = keepalive.DEFAULT_TIMEOUT

    @property
    def resolved_models_dir(self) -> Path:
        return self.models_dir if self.models_dir is not None else self.data_dir / "models"

    @property
    def resolved_runtime_log_dir(self) -> Path:
        return self.runtime_log_dir if self.runtime_log_dir is not None else self.data_dir / "logs"

    def inventory_labels(self) -> dict[str, str]:
        labels = {**self.labels, SLOTS_LABEL: str(self.slots)}
        if self.transfer_port:
            labels[TRANSFER_PORT_LABEL] = str(self.transfer_port)
        if self.memory_limit_bytes is not None:
            labels[MEMORY_LIMIT_LABEL] = str(self.memory_limit_bytes)
        return labels


# ---------------------------------------------------------------------------
# Backoff
# ---------------------------------------------------------------------------


class Backoff:
    """Capped exponential backoff with full jitter: attempt n waits
    ``uniform(0, min(maximum, initial * 2**n))``."""

    def __init__(self, initial: float, maximum: float, jitter: Jitter | None = None) -> None:
        if initial <= 0 or maximum < initial:
            raise ConfigError(f"bad backoff: initial={initial}, maximum={maximum}")
        self.initial = initial
        self.maximum = maximum
        self.jitter: Jitter = jitter if jitter is not None else random.uniform
        self.attempt = 0

    def ceiling(self) -> float:
        return min(self.maximum, self.initial * 2.0 ** min(self.attempt, 64))

    def next_delay(self) -> float:
        ceiling = self.ceiling()
        self.attempt += 1
        return max(0.0, min(ceiling, self.jitter(0.0, ceiling)))

    def reset(self) -> None:
        self.attempt = 0
