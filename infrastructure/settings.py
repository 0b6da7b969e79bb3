"""Controller configuration from the environment (see docs/reference.md, 'Configuration')."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from application.admission import DEFAULT_QUEUE_MAX, DEFAULT_QUEUE_TIMEOUT
from application.deadlines import (
    DEFAULT_FIRST_TOKEN_TIMEOUT,
    DEFAULT_STREAM_IDLE_TIMEOUT,
    Deadlines,
)
from application.feed_tickets import DEFAULT_FEED_SESSION_SECONDS
from application.link_probes import DEFAULT_LINK_PROBE_INTERVAL
from application.metrics_history import DEFAULT_HISTORY_INTERVAL
from application.runtime_reaper import DEFAULT_RPC_WORKER_IDLE_GRACE, DEFAULT_SERVER_IDLE_GRACE
from common.contract import (
    AGENT_RECEIVE_BYTES,
    DEFAULT_ALLOWED_PEER_CIDRS,
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MODEL_STORE_PORT,
    DEFAULT_RPC_PORT,
    PLAN_OVERHEAD_BYTES,
)
from common.model_file_server import (
    DEFAULT_CONNECTIONS_PER_ADDRESS,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_WORKERS,
)
from common.model_sources import parse_cidrs
from domain.placement import DEFAULT_MIN_SPLIT_LINK_MBPS
from wire import keepalive

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: How long a stopping controller (SIGTERM, SIGINT) waits for its running jobs (s).
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: A request travels to its primary in one plan message, which the agent must let in.
MAX_REQUEST_BYTES_LIMIT = AGENT_RECEIVE_BYTES - PLAN_OVERHEAD_BYTES


#: Every environment variable :meth:`Settings.from_env` reads (the config file's keys too).
SETTING_NAMES = (
    "ADMIN_API_KEY",
    "AI_API_KEY",
    "ALLOWED_PEER_CIDRS",
    "DACP_VAR_DIR",
    "DATABASE_POOL_SIZE",
    "DATABASE_URL",
    "DEGRADED_AFTER",
    "ENROLL_ALLOW_NAT",
    "FAIR_QUEUEING",
    "FEED_SESSION_SECONDS",
    "FIRST_TOKEN_TIMEOUT",
    "GRPC_HOST",
    "GRPC_INSECURE",
    "GRPC_KEEPALIVE_INTERVAL",
    "GRPC_KEEPALIVE_TIMEOUT",
    "GRPC_PORT",
    "HEARTBEAT_INTERVAL",
    "HOST",
    "LINK_PROBE_INTERVAL",
    "MAX_REQUEST_BYTES",
    "METRICS_HISTORY_INTERVAL",
    "MIN_SPLIT_LINK_MBPS",
    "MODEL_SOURCE_ALLOWED_CIDRS",
    "MODEL_STORE_CONNECTIONS_PER_ADDRESS",
    "MODEL_STORE_DIR",
    "MODEL_STORE_HANDSHAKE_TIMEOUT",
    "MODEL_STORE_PORT",
    "MODEL_STORE_WORKERS",
    "NODE_ENROLLMENT_SECRET",
    "OFFLINE_AFTER",
    "OPEN_API",
    "PORT",
    "PREFIX_ROUTING",
    "QUEUE_MAX",
    "QUEUE_TIMEOUT",
    "RECORD_CONTENT",
    "REDIS_KEY_PREFIX",
    "REDIS_URL",
    "REQUEST_TIMEOUT",
    "RPC_PORT",
    "RPC_WORKER_IDLE_GRACE",
    "RPC_WORKER_START_TIMEOUT",
    "SERVER_IDLE_GRACE",
    "SETUP_TIMEOUT",
    "SHUTDOWN_TIMEOUT",
    "SHUTDOWN_TIMEOUT",
    "STREAM_IDLE_TIMEOUT",
    "TLS_CA_FILE",
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "TOKEN_RECORD_INTERVAL",
)


def default_var_dir(env: Mapping[str, str]) -> Path:
    """Where a controller keeps its state unless ``DACP_VAR_DIR`` says otherwise:
    ``$XDG_DATA_HOME/dacp`` (default ``~/.local/share/dacp``), never the current directory."""
    xdg = env.get("XDG_DATA_HOME", "").strip()
    root = Path(xdg) if xdg else Path(env.get("HOME") or Path.home()) / ".local" / "share"
    return root / "dacp"


class SettingsError(ValueError):
    """A configuration value is malformed; the message names the variable."""


def _float(
    env: Mapping[str, str],
    key: str,
    default: float,
    *,
    zero_means_off: bool = False,
    unit: str = "seconds",
) -> float:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as e:
        raise SettingsError(f"{key} must be a number of {unit}, got {raw!r}") from e
    if not 0 <= value < float("inf") or (value == 0 and not zero_means_off):
        limit = "at least 0 (0: off)" if zero_means_off else "positive"
        raise SettingsError(f"{key} must be {limit}, got {raw!r}")
    return value


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise SettingsError(f"{key} must be an integer, got {raw!r}") from e


def _bool(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "y", "on"):
        return True
    if raw in ("0", "false", "no", "n", "off"):
        return False
    raise SettingsError(f"{key} must be true or false, got {raw!r}")


def _path(env: Mapping[str, str], key: str) -> Path | None:
    raw = env.get(key, "").strip()
    return Path(raw).expanduser() if raw else None


def _store_port(env: Mapping[str, str]) -> int | None:
    raw = env.get("MODEL_STORE_PORT", "").strip().lower()
    if raw == "off":
        return None
    port = _int(env, "MODEL_STORE_PORT", DEFAULT_MODEL_STORE_PORT)
    if not 0 <= port <= 65535:
        raise SettingsError(f"MODEL_STORE_PORT must be a port or off, got {port}")
    return port


@dataclass(frozen=True)
class Settings:
    database_url: str | None = None
    database_pool_size: int = 5
    redis_url: str | None = None
    redis_key_prefix: str = "dacp:live:"
    ai_api_key: str | None = None
    admin_api_key: str | None = None
    node_enrollment_secret: str | None = None
    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    grpc_host: str = "127.0.0.1"
    grpc_port: int = DEFAULT_GRPC_PORT
    rpc_port: int = DEFAULT_RPC_PORT
    heartbeat_interval: float = 2.0
    degraded_after: float = 6.0
    offline_after: float = 15.0
    allowed_peer_cidrs: tuple[str, ...] = DEFAULT_ALLOWED_PEER_CIDRS
    record_content: bool = True
    rpc_worker_timeout: float = 30.0
    #: How long an RPC worker no job uses stays up for warm reuse (then StopRpcWorker).
    rpc_worker_idle_grace: float = DEFAULT_RPC_WORKER_IDLE_GRACE
    #: How long a one-node llama-server no job uses stays up for warm reuse (then StopServer).
    server_idle_grace: float = DEFAULT_SERVER_IDLE_GRACE
    setup_timeout: float = 120.0
    #: How long SIGTERM/SIGINT waits for running jobs before it ends them (0: not at all).
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT
    queue_max: int = DEFAULT_QUEUE_MAX
    #: API keys take turns in a model's admission queue, interactive before batch
    #: (application/admission.py); FAIR_QUEUEING=off: first in, first out.
    fair_queueing: bool = True
    token_record_interval: float = 1.0
    first_token_timeout: float = DEFAULT_FIRST_TOKEN_TIMEOUT
    stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT
    request_timeout: float = 0.0  # off
    keepalive_interval: float = keepalive.DEFAULT_INTERVAL
    keepalive_timeout: float = keepalive.DEFAULT_TIMEOUT
    #: Never the current directory: DACP_VAR_DIR, else the XDG data directory.
    var_dir: Path = field(default_factory=lambda: default_var_dir(os.environ))
    #: Plaintext gRPC and plain HTTP: only with GRPC_INSECURE=true (or ``--insecure``).
    insecure: bool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None
    #: Enrollment accepts an advertised address other than the connection's source (NAT).
    enroll_allow_nat: bool = False
    #: The largest HTTP request body (413 `request_too_large` beyond).
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    #: The controller's own model store (``dacp models add``); None: ``<var>/models``.
    model_store_path: Path | None = None
    #: Where nodes fetch the store's files (on GRPC_HOST; 0: any free port; None: not served,
    #: MODEL_STORE_PORT=off).
    model_store_port: int | None = DEFAULT_MODEL_STORE_PORT
    #: Serve /v1 without AI_API_KEY beyond loopback (``--open-api``, OPEN_API=true); without
    #: it such a controller refuses to start.
    open_api: bool = False
    #: How long a live-feed stream opened with a ticket lasts from the ticket's minting (s).
    feed_session_seconds: float = DEFAULT_FEED_SESSION_SECONDS
    #: Seconds between the samples of the dashboard's charts (GET /api/admin/metrics/history).
    metrics_history_interval: float = DEFAULT_HISTORY_INTERVAL
    #: Seconds a connection to the store has for its TLS handshake and request head.
    model_store_handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    #: Threads sending the store's files at once.
    model_store_workers: int = DEFAULT_WORKERS
    #: Connections open at once to the store from one address.
    model_store_connections_per_address: int = DEFAULT_CONNECTIONS_PER_ADDRESS
    #: Networks a model's http(s) source may be on although they are refused by default
    #: (loopback, link-local, metadata: common/model_sources.py); agents get them in FetchModel.
    model_source_allowed_cidrs: tuple[str, ...] = ()
    #: A conversation's next turn goes to the warm server holding its prompt's prefix
    #: (application/prefix_routing.py); PREFIX_ROUTING=off places every job as if it had none.
    prefix_routing: bool = True
    #: How often each node measures its links to its peers (application/link_probes.py).
    link_probe_interval: float = DEFAULT_LINK_PROBE_INTERVAL
    #: No split over a link measured slower than this, in Mbit/s (0: any link).
    min_split_link_mbps: float = DEFAULT_MIN_SPLIT_LINK_MBPS

    @property
    def model_store_dir(self) -> Path:
        return self.model_store_path or self.var_dir / "models"

    @property
    def tls_dir(self) -> Path:
        """Where the controller keeps its CA and the certificate it issues itself."""
        return self.var_dir / "tls"

    def deadlines(self) -> Deadlines:
        return Deadlines(self.first_token_timeout, self.stream_idle_timeout, self.request_timeout)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        cidrs = tuple(c.strip() for c in env.get("ALLOWED_PEER_CIDRS", "").split(",") if c.strip())
        base = cls()  # the defaults are the dataclass's, stated once
        settings = cls(
            database_url=env.get("DATABASE_URL") or None,
            database_pool_size=_int(env, "DATABASE_POOL_SIZE", base.database_pool_size),
            redis_url=env.get("REDIS_URL") or None,
            redis_key_prefix=env.get("REDIS_KEY_PREFIX") or base.redis_key_prefix,
            ai_api_key=env.get("AI_API_KEY") or None,
            admin_api_key=env.get("ADMIN_API_KEY") or None,
            node_enrollment_secret=env.get("NODE_ENROLLMENT_SECRET") or None,
            host=env.get("HOST", base.host),
            port=_int(env, "PORT", base.port),
            grpc_host=env.get("GRPC_HOST", base.grpc_host),
            grpc_port=_int(env, "GRPC_PORT", base.grpc_port),
            rpc_port=_int(env, "RPC_PORT", base.rpc_port),
            heartbeat_interval=_float(env, "HEARTBEAT_INTERVAL", base.heartbeat_interval),
            degraded_after=_float(env, "DEGRADED_AFTER", base.degraded_after),
            offline_after=_float(env, "OFFLINE_AFTER", base.offline_after),
            allowed_peer_cidrs=cidrs or base.allowed_peer_cidrs,
            record_content=_bool(env, "RECORD_CONTENT", base.record_content),
            rpc_worker_timeout=_float(env, "RPC_WORKER_START_TIMEOUT", base.rpc_worker_timeout),
            rpc_worker_idle_grace=_float(env, "RPC_WORKER_IDLE_GRACE", base.rpc_worker_idle_grace),
            server_idle_grace=_float(env, "SERVER_IDLE_GRACE", base.server_idle_grace),
            setup_timeout=_float(env, "SETUP_TIMEOUT", base.setup_timeout),
            shutdown_timeout=_float(
                env, "SHUTDOWN_TIMEOUT", base.shutdown_timeout, zero_means_off=True
            ),
            queue_timeout=_float(env, "QUEUE_TIMEOUT", base.queue_timeout),
            queue_max=_int(env, "QUEUE_MAX", base.queue_max),
            fair_queueing=_bool(env, "FAIR_QUEUEING", base.fair_queueing),
            token_record_interval=_float(env, "TOKEN_RECORD_INTERVAL", base.token_record_interval),
            first_token_timeout=_float(env, "FIRST_TOKEN_TIMEOUT", base.first_token_timeout),
            stream_idle_timeout=_float(env, "STREAM_IDLE_TIMEOUT", base.stream_idle_timeout),
            request_timeout=_float(
                env, "REQUEST_TIMEOUT", base.request_timeout, zero_means_off=True
            ),
            keepalive_interval=_float(env, "GRPC_KEEPALIVE_INTERVAL", base.keepalive_interval),
            keepalive_timeout=_float(env, "GRPC_KEEPALIVE_TIMEOUT", base.keepalive_timeout),
            var_dir=Path(env.get("DACP_VAR_DIR") or default_var_dir(env)).expanduser(),
            insecure=_bool(env, "GRPC_INSECURE", base.insecure),
            tls_cert_file=_path(env, "TLS_CERT_FILE"),
            tls_key_file=_path(env, "TLS_KEY_FILE"),
            tls_ca_file=_path(env, "TLS_CA_FILE"),
            max_request_bytes=_int(env, "MAX_REQUEST_BYTES", base.max_request_bytes),
            enroll_allow_nat=_bool(env, "ENROLL_ALLOW_NAT", base.enroll_allow_nat),
            model_store_path=_path(env, "MODEL_STORE_DIR"),
            model_store_port=_store_port(env),
            open_api=_bool(env, "OPEN_API", base.open_api),
            feed_session_seconds=_float(env, "FEED_SESSION_SECONDS", base.feed_session_seconds),
            metrics_history_interval=_float(
                env, "METRICS_HISTORY_INTERVAL", base.metrics_history_interval
            ),
            model_store_handshake_timeout=_float(
                env, "MODEL_STORE_HANDSHAKE_TIMEOUT", base.model_store_handshake_timeout
            ),
            model_store_workers=_int(env, "MODEL_STORE_WORKERS", base.model_store_workers),
            model_store_connections_per_address=_int(
                env, "MODEL_STORE_CONNECTIONS_PER_ADDRESS", base.model_store_connections_per_address
            ),
            model_source_allowed_cidrs=tuple(
                c.strip() for c in env.get("MODEL_SOURCE_ALLOWED_CIDRS", "").split(",") if c.strip()
            ),
            prefix_routing=_bool(env, "PREFIX_ROUTING", base.prefix_routing),
            link_probe_interval=_float(env, "LINK_PROBE_INTERVAL", base.link_probe_interval),
            min_split_link_mbps=_float(
                env,
                "MIN_SPLIT_LINK_MBPS",
                base.min_split_link_mbps,
                zero_means_off=True,
                unit="Mbit/s",
            ),
        )
        try:
            settings.deadlines()
        except ValueError as e:
            raise SettingsError(
                "FIRST_TOKEN_TIMEOUT and STREAM_IDLE_TIMEOUT must be positive and "
                f"REQUEST_TIMEOUT at least 0 (0: off): {e}"
            ) from None
        if settings.token_record_interval <= 0:
            raise SettingsError(
                f"TOKEN_RECORD_INTERVAL must be positive, got {settings.token_record_interval}"
            )
        if not 1024 <= settings.max_request_bytes <= MAX_REQUEST_BYTES_LIMIT:
            raise SettingsError(
                f"MAX_REQUEST_BYTES must be between 1024 and {MAX_REQUEST_BYTES_LIMIT} (what one "
                f"message to an agent carries), got {settings.max_request_bytes}"
            )
        if settings.rpc_worker_idle_grace <= 0:
            raise SettingsError(
                f"RPC_WORKER_IDLE_GRACE must be positive, got {settings.rpc_worker_idle_grace}"
            )
        if settings.link_probe_interval <= 0:
            raise SettingsError(
                f"LINK_PROBE_INTERVAL must be positive, got {settings.link_probe_interval}"
            )
        if settings.server_idle_grace <= 0:
            raise SettingsError(
                f"SERVER_IDLE_GRACE must be positive, got {settings.server_idle_grace}"
            )
        if settings.queue_max < 1:
            raise SettingsError(f"QUEUE_MAX must be at least 1, got {settings.queue_max}")
        try:
            parse_cidrs(settings.model_source_allowed_cidrs)
        except ValueError as e:
            raise SettingsError(str(e)) from None
        for key, count in (
            ("MODEL_STORE_WORKERS", settings.model_store_workers),
            ("MODEL_STORE_CONNECTIONS_PER_ADDRESS", settings.model_store_connections_per_address),
        ):
            if count < 1:
                raise SettingsError(f"{key} must be at least 1, got {count}")
        if settings.offline_after <= settings.degraded_after:
            raise SettingsError(
                f"OFFLINE_AFTER ({settings.offline_after}) must exceed "
                f"DEGRADED_AFTER ({settings.degraded_after})"
            )
        return settings
