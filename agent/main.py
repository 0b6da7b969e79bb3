"""``node-agent``: enroll this machine with the controller and keep its control stream open.

Exit codes: 0 after a clean stop (the first SIGINT/SIGTERM/SIGHUP/Ctrl+C drains the agent:
its running jobs finish, at most ``--drain-timeout``); 128 + the signal's number when a second
signal stopped it at once (its running jobs lost); 2 with a one-line message for bad
flags, a garbled, truncated or refused enrollment token, an address that answers HTTP, a
controller that fails the pin at enrollment (it shows another CA, or a certificate of the
pinned CA that is not the controller's), a rejected stored identity, no token and no identity,
or missing llama.cpp binaries (unless ``--no-runtime``).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import agent.grpc_fork  # noqa: F401  # before anything imports grpc
from agent import AGENT_VERSION, grpc_logging  # grpc_logging: before anything imports grpc
from agent.agent_config import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_SLOTS,
    RESERVED_LABELS,
    AgentConfig,
    AgentError,
    ConfigError,
    Jitter,
    MissingEnrollmentToken,
    parse_byte_size,
    parse_controller_url,
)
from agent.agent_stop import install_signal_handlers as stop_on_signals
from agent.control.control_client import AgentSession
from agent.control.control_handler import ControlHandler
from agent.control.controller_tls import checked_token
from agent.handler_factory import build_handler
from agent.models.fetch_limits import add_fetch_arguments, fetch_limits_from_args
from agent.node.advertise_address import default_advertise_address
from agent.node.identity import IdentityFileError, load_identity
from agent.runtime.llama_binaries import add_binaries_arguments
from agent.runtime.llama_server import log_health_polls_at_debug
from common import event_loop
from common.contract import (
    DEFAULT_ALLOWED_PEER_CIDRS,
    DEFAULT_GRPC_PORT,
    DEFAULT_RPC_PORT,
    DEFAULT_TRANSFER_PORT,
    SLOTS_LABEL,
)

PROG = "node-agent"
EXIT_OK = 0
EXIT_USAGE = 2
DATA_DIR_NAME = "dacp-agent"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _OneLineParser(argparse.ArgumentParser):
    """Reports bad flags as a single line (no usage dump) and exits with code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


# ---------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------


def default_data_dir() -> Path:
    """``%LOCALAPPDATA%\\dacp-agent`` on Windows, else ``$XDG_DATA_HOME/dacp-agent``
    (``~/.local/share/dacp-agent``)."""
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        root = Path(local) if local else Path.home() / "AppData" / "Local"
    else:
        xdg = os.environ.get("XDG_DATA_HOME")
        root = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return root / DATA_DIR_NAME


# ---------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text!r}")
    return value


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _poll_level(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be 0 to 100: {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return value


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value.strip()


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cidrs(text: str) -> tuple[str, ...]:
    cidrs = tuple(c.strip() for c in text.split(",") if c.strip())
    if not cidrs:
        raise argparse.ArgumentTypeError("expected at least one CIDR, e.g. 192.168.1.0/24")
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a CIDR: {cidr!r}") from None
    return cidrs


def _ip_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an IP address: {text!r}") from None


def _log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(LOG_LEVELS)}")
    return level


# ---------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=PROG,
        description=(
            "DACP node agent: enrolls this machine with the controller, reports its hardware "
            "and models, heartbeats, and runs llama.cpp work the controller assigns."
        ),
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {AGENT_VERSION}")
    parser.add_argument(
        "--foreground",
        action="store_true",
        help=(
            "run in the foreground (accepted for compatibility: this build always runs in the "
            "foreground; use systemd, launchd or a Windows service wrapper to background it)"
        ),
    )
    parser.add_argument(
        "--controller-url",
        default=os.environ.get("DACP_CONTROLLER_URL") or None,
        help=(
            "controller gRPC address: host:port, grpc://host:port (plaintext) or "
            f"grpcs://host:port (TLS); default port {DEFAULT_GRPC_PORT}; env DACP_CONTROLLER_URL. "
            "Optional once enrolled (the URL is stored with the identity)"
        ),
    )
    parser.add_argument(
        "--enrollment-token",
        default=os.environ.get("DACP_ENROLLMENT_TOKEN") or None,
        help=(
            "administrator-issued enrollment token, needed only for the first start; "
            "env DACP_ENROLLMENT_TOKEN"
        ),
    )
    parser.add_argument(
        "--node-name", default=socket.gethostname(), help="node name (default: hostname)"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="identity.json and the model hash cache (default: %(default)s)",
    )
    parser.add_argument(
        "--advertise-address",
        type=_ip_address,
        default=None,
        help=(
            "private LAN address other nodes use for llama.cpp RPC (default: the first "
            "non-loopback private IPv4 address, else 127.0.0.1)"
        ),
    )
    parser.add_argument(
        "--rpc-port",
        type=_port,
        default=DEFAULT_RPC_PORT,
        help="ggml-rpc-server port on this node (default: %(default)s)",
    )
    parser.add_argument(
        "--transfer-port",
        type=int,
        default=DEFAULT_TRANSFER_PORT,
        help="port of this node's model file server, for other nodes (0: none; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--allowed-peer-cidrs",
        type=_cidrs,
        default=os.environ.get("ALLOWED_PEER_CIDRS") or ",".join(DEFAULT_ALLOWED_PEER_CIDRS),
        metavar="CIDR[,CIDR...]",
        help=(
            "where primaries allowed to use this node's RPC worker may be; a primary the "
            "controller names outside them is not let in (default: private and loopback "
            "ranges; env ALLOWED_PEER_CIDRS)"
        ),
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help="GGUF models (default: <data-dir>/models)"
    )
    add_binaries_arguments(parser)
    parser.add_argument(
        "--no-runtime",
        action="store_true",
        help="run without llama.cpp: enroll and report, but refuse every job",
    )
    parser.add_argument(
        "--runtime-log-dir",
        type=Path,
        default=None,
        help="log files of llama-server and ggml-rpc-server (default: <data-dir>/logs)",
    )
    parser.add_argument(
        "--memory-limit",
        type=_byte_size,
        default=None,
        metavar="BYTES",
        help=(
            "memory this agent offers to the scheduler, per device (each GPU and the host "
            "memory), in bytes or with a K/M/G/T suffix (powers of 1024), e.g. 2G (default: "
            "no limit beyond the hardware)"
        ),
    )
    parser.add_argument(
        "--models-disk-limit",
        type=_byte_size,
        default=os.environ.get("MODELS_DISK_LIMIT") or None,
        metavar="SIZE",
        help=(
            "most the *.gguf (and .partial) files in --models-dir may hold, in bytes or with a "
            "K/M/G/T suffix, e.g. 200G; a fetch that would go beyond it is refused "
            "(default: no limit beyond the disk; env MODELS_DISK_LIMIT)"
        ),
    )
    add_fetch_arguments(parser, seconds=_positive_float, size=_byte_size)
    parser.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="override the heartbeat interval the controller asks for",
    )
    parser.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=os.environ.get("DACP_DRAIN_TIMEOUT") or DEFAULT_DRAIN_TIMEOUT,
        metavar="SECONDS",
        help=(
            "on the first SIGINT/SIGTERM, how long running jobs may take to finish before the "
            "agent stops anyway (a second signal stops it at once; 0: no drain); "
            "default: %(default)s; env DACP_DRAIN_TIMEOUT"
        ),
    )
    parser.add_argument(
        "--label",
        type=_label,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="node label reported to the controller (repeatable)",
    )
    parser.add_argument(
        "--slots",
        type=_positive_int,
        default=DEFAULT_SLOTS,
        help=(
            "most jobs this node serves at once as a primary: llama-server slots; the "
            "controller gives each server as many as memory holds for the model's context, "
            "up to this (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        # A string default is converted (and checked) by ``type`` as the flag would be.
        default=os.environ.get("DACP_THREADS") or None,
        help=(
            "CPU threads each llama.cpp process of this node computes with (llama-server, "
            "the RPC worker); default: llama.cpp's own, every core. Set it where the node "
            "shares its cores (several agents on one machine); env DACP_THREADS"
        ),
    )
    parser.add_argument(
        "--poll",
        type=_poll_level,
        default=os.environ.get("DACP_POLL") or str(AgentConfig.poll),
        metavar="0-100",
        help=(
            "how long llama-server's idle compute threads spin for work before they sleep "
            "(its --poll; llama.cpp's own default is 50). 0 frees the cores between tokens "
            "for the agent, which relays them (default: %(default)s); env DACP_POLL"
        ),
    )
    parser.add_argument(
        "--stream-interval",
        type=_non_negative_float,
        default=os.environ.get("DACP_STREAM_INTERVAL") or AgentConfig.stream_interval,
        metavar="SECONDS",
        help=(
            "the shortest time between two messages of a job's tokens to the controller, "
            "after its first (which never waits): the tokens meanwhile go together. 0: each "
            "as it comes; longer costs the node's cores less (default: %(default)s); env "
            "DACP_STREAM_INTERVAL"
        ),
    )
    parser.add_argument(
        "--tls-ca-file",
        type=Path,
        default=os.environ.get("DACP_TLS_CA_FILE") or None,
        help="PEM CA bundle for grpcs:// (default: system roots); env DACP_TLS_CA_FILE",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=_env_true("GRPC_INSECURE"),
        help=(
            "talk to the controller in PLAINTEXT (its credential and every prompt readable on "
            "the network); the default is TLS, pinned to the CA the enrollment token names; "
            "env GRPC_INSECURE=true"
        ),
    )
    grpc_logging.add_grpc_debug_argument(parser)
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default="INFO",
        help=f"one of {', '.join(LOG_LEVELS)} (default: %(default)s)",
    )
    return parser


async def run_agent(
    config: AgentConfig,
    handler: ControlHandler,
    *,
    install_signal_handlers: bool = True,
    jitter: Jitter | None = None,
) -> int:
    """Run one agent session until SIGINT/SIGTERM (or a fatal :class:`AgentError`); returns
    the exit status (:attr:`AgentSession.exit_code`)."""
    session = AgentSession(config, handler, jitter=jitter)
    installed = stop_on_signals(session.on_signal) if install_signal_handlers else []
    try:
        await session.run()
        return session.exit_code
    finally:
        loop = asyncio.get_running_loop()
        for sig in installed:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)


def _stored_controller_url(data_dir: Path) -> str | None:
    try:
        identity = load_identity(data_dir)
    except IdentityFileError:
        return None
    return identity.controller_url if identity else None


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    labels = dict(args.label)
    for reserved in sorted(RESERVED_LABELS & labels.keys()):
        flag = "--slots" if reserved == SLOTS_LABEL else "--memory-limit"
        raise ConfigError(f"label {reserved!r} is reserved; use {flag}")
    data_dir = Path(args.data_dir).expanduser()
    return AgentConfig(
        data_dir=data_dir,
        node_name=args.node_name.strip() or socket.gethostname(),
        controller_url=args.controller_url,
        enrollment_token=args.enrollment_token,
        models_dir=Path(args.models_dir).expanduser() if args.models_dir else None,
        advertise_address=args.advertise_address
        or default_advertise_address(args.controller_url or _stored_controller_url(data_dir)),
        rpc_port=args.rpc_port,
        transfer_port=args.transfer_port,
        allowed_peer_cidrs=args.allowed_peer_cidrs,
        labels=labels,
        slots=args.slots,
        threads=args.threads,
        poll=args.poll,
        stream_interval=args.stream_interval,
        llama_bin_dir=Path(args.llama_bin_dir).expanduser() if args.llama_bin_dir else None,
        llama_backend=args.llama_backend,
        heartbeat_interval=args.heartbeat_interval,
        drain_timeout=args.drain_timeout,
        tls_ca_file=Path(args.tls_ca_file).expanduser() if args.tls_ca_file else None,
        insecure=args.insecure,
        memory_limit_bytes=args.memory_limit,
        models_disk_limit_bytes=args.models_disk_limit,
        fetch_limits=fetch_limits_from_args(args),
        llama_runtime=not args.no_runtime,
        runtime_log_dir=Path(args.runtime_log_dir).expanduser() if args.runtime_log_dir else None,
    )


def preflight(config: AgentConfig) -> None:
    """Fail fast (before discovery) on what would make the session fail anyway."""
    identity = load_identity(config.data_dir)
    if identity is None and not config.enrollment_token:
        raise MissingEnrollmentToken(
            f"no enrollment token and no stored identity in {config.data_dir}; "
            "pass --enrollment-token or set DACP_ENROLLMENT_TOKEN"
        )
    if identity is None and config.enrollment_token:
        checked_token(config.enrollment_token)  # garbled or truncated: named, sent nowhere
    url = config.controller_url or (identity.controller_url if identity else None)
    if not url:
        raise ConfigError("no controller URL: pass --controller-url or set DACP_CONTROLLER_URL")
    target = parse_controller_url(url, insecure=config.insecure)
    if config.insecure:
        logging.getLogger(__name__).warning(
            "--insecure: the control channel is PLAINTEXT; this node's credential and every "
            "prompt and answer cross the network readable by anyone on it"
        )
    if config.tls_ca_file is not None:
        if not target.secure:
            logging.getLogger(__name__).warning(
                "--tls-ca-file is ignored for the plaintext controller URL %s", target.url
            )
        elif not config.tls_ca_file.is_file():
            raise ConfigError(f"TLS CA file not found: {config.tls_ca_file}")


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log_health_polls_at_debug()  # several a second while a model loads


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level)
    try:
        config = config_from_args(args)
        preflight(config)
        handler = build_handler(config)
        return event_loop.run(run_agent(config, handler))
    except (AgentError, IdentityFileError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:  # Windows: no loop signal handlers; Ctrl+C lands here
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
