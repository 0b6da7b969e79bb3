"""Runtime manager for the llama.cpp child processes of a node agent.

* :func:`find_binaries` locates ``llama-server`` and ``ggml-rpc-server`` (flag, then
  ``$DACP_LLAMA_BIN_DIR``, then the build cache written by ``python -m ops.build_llama``).
* :class:`RpcWorker` runs ``ggml-rpc-server`` bound to one private address (never ``0.0.0.0``:
  the RPC protocol is unauthenticated).
* :class:`LlamaServer` runs ``llama-server`` on a free loopback port, optionally spreading layers
  over RPC workers (``--rpc``, ``-ts``, ``-ngl``), and streams OpenAI-style chat completions.
* :class:`RuntimeManager` keeps one warm ``llama-server`` per spec and the local RPC workers.

Children write stdout and stderr to one log file each in the given log directory, so pipes never
fill. They die with the agent: on Linux every child is forked from one long-lived thread with
``PR_SET_PDEATHSIG`` set to ``SIGKILL``; everywhere, :meth:`RuntimeManager.close` and an ``atexit``
hook stop whatever is still running. An unexpected exit is reported to the ``on_exit`` callback
(called from a watcher thread) and raised as :class:`RuntimeCrashedError` with the last lines of
the child's output.

This module imports only the standard library and ``httpx`` (agent code never imports the
controller or ``ops``). Blocking calls (starting processes and waiting for readiness) are
synchronous; from asyncio use :meth:`RuntimeManager.ensure_server_async` or
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime as dt
import ipaddress
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.child_process import spawn_tied_to_agent

log = logging.getLogger(__name__)

LLAMA_DIST_VERSION = "11434.0.0"
ENV_BIN_DIR = "DACP_LLAMA_BIN_DIR"
ENV_CACHE_DIR = "DACP_CACHE_DIR"
DEFAULT_RPC_PORT = 50052
DEFAULT_CTX_SIZE = 4096
# With RPC workers every repeating layer goes to the workers unless the plan says otherwise.
RPC_DEFAULT_GPU_LAYERS = 99

_EXE = ".exe" if sys.platform == "win32" else ""
LLAMA_SERVER_NAMES: tuple[str, ...] = (f"llama-server{_EXE}",)
# `ggml-rpc-server` is the current target name; older llama.cpp builds called it `rpc-server`.
RPC_SERVER_NAMES: tuple[str, ...] = (f"ggml-rpc-server{_EXE}", f"rpc-server{_EXE}")
_TAIL_BYTES = 64 * 1024
_STOP_GRACE_SECONDS = 5.0
# Settings a parent shell could leak into llama.cpp via environment variables; the spec decides.
_SCRUBBED_ENV_PREFIXES = ("LLAMA_ARG_",)
# On abort ggml attaches gdb to print a backtrace: slow, and it buries the real error line.
_DEFAULT_CHILD_ENV = {"GGML_NO_BACKTRACE": "1"}
_LOG_ROTATE_BYTES = 16 * 1024 * 1024
# llama-server verbosity 4 ("trace") logs device placement, buffer sizes and per-request timings.
DEFAULT_SERVER_VERBOSITY = 4


# --- errors ------------------------------------------------------------------------------


class LlamaRuntimeError(Exception):
    """Base class of everything this module raises."""


class RuntimeMissingError(LlamaRuntimeError):
    """A llama.cpp binary (or the model file) is not where it should be."""


class UnsafeBindError(LlamaRuntimeError, ValueError):
    """Refused to bind an RPC worker to a wildcard, public or malformed address."""


class PortInUseError(LlamaRuntimeError):
    """The requested port is already taken by another process."""


class _ProcessFailure(LlamaRuntimeError):
    def __init__(
        self,
        message: str,
        *,
        role: str,
        exit_code: int | None = None,
        stderr_tail: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        key = key_error_line(stderr_tail)
        super().__init__(f"{message}; last output: {key}" if key else message)
        self.role = role
        self.exit_code = exit_code
        self.stderr_tail = list(stderr_tail)
        self.log_path = log_path


_ABORT_LINE = re.compile(r"\.(?:c|cc|cpp|h):\d+: ")  # GGML_ABORT / GGML_ASSERT location
_ERROR_LINE = re.compile(r"\berror\b|\bfailed\b|terminate called|what\(\)|\s[EF]\s", re.IGNORECASE)


def key_error_line(lines: Sequence[str]) -> str:
    """The most telling line of a child's last output: an abort site, an error, or the last."""
    lines = [line.strip() for line in lines if line.strip()]
    for pattern in (_ABORT_LINE, _ERROR_LINE):
        for line in reversed(lines):
            if pattern.search(line):
                return line
    return lines[-1] if lines else ""


class RuntimeStartError(_ProcessFailure):
    """A child process did not become ready (exited early or timed out)."""


class RuntimeCrashedError(_ProcessFailure):
    """A child process that was running exited without being asked to."""


class GenerationError(LlamaRuntimeError):
    """llama-server rejected or aborted a generation request."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


# --- binaries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeBinaries:
    bin_dir: Path
    llama_server: Path
    rpc_server: Path


def default_cache_dir() -> Path:
    """``$DACP_CACHE_DIR`` or ``~/.cache/dacp`` (same rule as ``ops/paths.py``)."""
    configured = os.environ.get(ENV_CACHE_DIR)
    if configured:
        return Path(configured).expanduser().resolve()
    return (Path.home() / ".cache" / "dacp").resolve()


def default_bin_dir() -> Path:
    """Where ``python -m ops.build_llama`` puts the binaries."""
    return default_cache_dir() / "llama.cpp" / LLAMA_DIST_VERSION / "bin"


def find_binaries(explicit_dir: str | os.PathLike[str] | None = None) -> RuntimeBinaries:
    """Locate ``llama-server`` and ``ggml-rpc-server``.

    The first configured source wins (no silent fallback past an explicit choice): the
    ``explicit_dir`` argument (the agent's ``--llama-bin-dir`` flag), ``$DACP_LLAMA_BIN_DIR``,
    then the build cache. Raises :class:`RuntimeMissingError` with a one-line reason.
    """
    env_dir = os.environ.get(ENV_BIN_DIR)
    if explicit_dir is not None and str(explicit_dir) != "":
        bin_dir, source = Path(explicit_dir).expanduser(), "--llama-bin-dir"
    elif env_dir:
        bin_dir, source = Path(env_dir).expanduser(), f"${ENV_BIN_DIR}"
    else:
        bin_dir, source = default_bin_dir(), "the build cache"
    hint = "run `python -m ops.build_llama` (or `make llama`) or set " + ENV_BIN_DIR
    if not bin_dir.is_dir():
        raise RuntimeMissingError(f"llama.cpp bin dir {bin_dir} (from {source}) missing; {hint}")
    llama_server = _find_executable(bin_dir, LLAMA_SERVER_NAMES)
    if llama_server is None:
        raise RuntimeMissingError(f"llama-server not found in {bin_dir} (from {source}); {hint}")
    rpc_server = _find_executable(bin_dir, RPC_SERVER_NAMES)
    if rpc_server is None:
        raise RuntimeMissingError(f"ggml-rpc-server not found in {bin_dir} (from {source}); {hint}")
    return RuntimeBinaries(
        bin_dir=bin_dir.resolve(), llama_server=llama_server, rpc_server=rpc_server
    )


def _find_executable(bin_dir: Path, names: Sequence[str]) -> Path | None:
    for name in names:
        candidate = bin_dir / name
        if candidate.is_file() and (sys.platform == "win32" or os.access(candidate, os.X_OK)):
            return candidate.resolve()
    return None


# --- addresses and ports -----------------------------------------------------------------


def validate_rpc_bind_host(host: str, *, allow_public: bool = False) -> str:
    """Return the IPv4 address an RPC worker may bind to, or raise :class:`UnsafeBindError`.

    ``ggml-rpc-server`` executes whatever graph a client sends and has no authentication, so it
    must listen on one private interface: wildcard (``0.0.0.0``), multicast, broadcast and (unless
    ``allow_public``) globally routable addresses are refused. It only speaks IPv4.
    """
    text = host.strip()
    if text.lower() == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise UnsafeBindError(f"RPC worker host must be an IPv4 address, got {host!r}") from None
    if address.version != 4:
        raise UnsafeBindError(f"ggml-rpc-server binds IPv4 only, got {host!r}")
    if address.is_unspecified:
        raise UnsafeBindError(
            f"refusing to bind ggml-rpc-server to {host}: the RPC protocol is unauthenticated; "
            "bind the node's private LAN address instead"
        )
    if address.is_multicast or address.is_reserved or text == "255.255.255.255":
        raise UnsafeBindError(f"refusing to bind ggml-rpc-server to {host}: not a host address")
    if address.is_global and not allow_public:
        raise UnsafeBindError(
            f"refusing to bind ggml-rpc-server to public address {host}; use a private address"
        )
    return str(address)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv4 or hostname) and validate the port."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"RPC endpoint must look like host:port, got {endpoint!r}")
    return host, int(port_text)


def probe_tcp(host: str, port: int, timeout: float = 1.0) -> bool:
    """True if something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_is_free(host: str, port: int) -> bool:
    """True if ``host:port`` can be bound right now (mirrors the servers' SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if sys.platform != "win32":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


_LIVE: set[_ChildProcess] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _kill_all_children() -> None:
    with _LIVE_LOCK:
        children = list(_LIVE)
    for child in children:
        with contextlib.suppress(Exception):
            child.stop(grace=1.0)


def _child_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}
    for key, value in _DEFAULT_CHILD_ENV.items():
        env.setdefault(key, value)
    if extra:
        env.update(extra)
    return env


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class ProcessExit:
    """Passed to ``on_exit`` when a child exits without being asked to."""

    role: str
    pid: int
    exit_code: int
    endpoint: str
    stderr_tail: list[str]
    log_path: Path

    def error(self) -> RuntimeCrashedError:
        return RuntimeCrashedError(
            f"{self.role} {self.endpoint} (pid {self.pid}) {describe_exit(self.exit_code)}",
            role=self.role,
            exit_code=self.exit_code,
            stderr_tail=self.stderr_tail,
            log_path=self.log_path,
        )


ExitCallback = Callable[[ProcessExit], None]


class _ChildProcess:
    """One llama.cpp child: spawn, log capture, stop, crash detection."""

    role = "child"

    def __init__(
        self,
        *,
        log_dir: Path,
        on_exit: ExitCallback | None,
        env: Mapping[str, str] | None,
    ) -> None:
        self.log_dir = Path(log_dir)
        self._on_exit = on_exit
        self._env = dict(env) if env else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._log_path: Path | None = None
        self._log_offset = 0
        self._watcher: threading.Thread | None = None

    # -- introspection --

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise LlamaRuntimeError(f"{self.role} has not been started")
        return self._log_path

    @property
    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def tail(self, lines: int = 20) -> list[str]:
        """Last lines this run wrote to stdout/stderr."""
        if self._log_path is None:
            return []
        try:
            with self._log_path.open("rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                start = max(self._log_offset, size - _TAIL_BYTES)
                handle.seek(start)
                data = handle.read()
        except OSError:
            return []
        text = data.decode("utf-8", errors="replace")
        return [line for line in text.splitlines() if line.strip()][-lines:]

    def log_text(self) -> str:
        """Everything this run wrote so far."""
        if self._log_path is None:
            return ""
        with self._log_path.open("rb") as handle:
            handle.seek(self._log_offset)
            return handle.read().decode("utf-8", errors="replace")

    def check(self) -> None:
        """Raise :class:`RuntimeCrashedError` if the child exited without being stopped."""
        if self._proc is None:
            raise LlamaRuntimeError(f"{self.role} has not been started")
        code = self._proc.poll()
        if code is not None and not self._stopping:
            raise self._exit_info(code).error()

    # -- lifecycle --

    def _spawn(self, argv: list[str], log_name: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self.log_dir / log_name
        self._stopping = False
        with contextlib.suppress(OSError):
            if self._log_path.stat().st_size > _LOG_ROTATE_BYTES:
                os.replace(self._log_path, self._log_path.with_name(log_name + ".1"))
        with self._log_path.open("ab") as log_file:
            stamp = dt.datetime.now().astimezone().isoformat(timespec="seconds")
            log_file.write(f"\n=== {stamp} starting: {shlex.join(argv)}\n".encode())
            log_file.flush()
            self._log_offset = log_file.tell()
            kwargs: dict[str, Any] = {
                "stdin": subprocess.DEVNULL,
                "stdout": log_file,
                "stderr": subprocess.STDOUT,
                "env": _child_env(self._env),
                "close_fds": True,
            }
            if sys.platform == "win32":
                kwargs["creationflags"] = getattr(subprocess, "CREATE_NO_WINDOW", 0)
            else:
                kwargs["start_new_session"] = True  # terminal signals go to the agent only
            try:
                self._proc = spawn_tied_to_agent(argv, **kwargs)
            except OSError as exc:
                raise RuntimeStartError(f"cannot start {argv[0]}: {exc}", role=self.role) from exc
        with _LIVE_LOCK:
            _LIVE.add(self)
        proc = self._proc
        self._watcher = threading.Thread(
            target=self._watch, args=(proc,), name=f"dacp-watch-{proc.pid}", daemon=True
        )
        self._watcher.start()
        log.info("started %s %s pid=%s log=%s", self.role, self.endpoint, proc.pid, self._log_path)

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._stopping or proc is not self._proc:
            return
        info = self._exit_info(code)
        log.warning("%s (log: %s)", info.error(), info.log_path)
        if self._on_exit is not None:
            try:
                self._on_exit(info)
            except Exception:
                log.exception("on_exit callback failed for %s", self.role)

    def _exit_info(self, code: int) -> ProcessExit:
        return ProcessExit(
            role=self.role,
            pid=self.pid or 0,
            exit_code=code,
            endpoint=self.endpoint,
            stderr_tail=self.tail(),
            log_path=self.log_path,
        )

    def _start_failure(self, reason: str) -> RuntimeStartError:
        return RuntimeStartError(
            f"{self.role} {self.endpoint} {reason}",
            role=self.role,
            exit_code=self.exit_code,
            stderr_tail=self.tail(),
            log_path=self._log_path,
        )

    def stop(self, grace: float = _STOP_GRACE_SECONDS) -> None:
        """Terminate (then kill after ``grace`` seconds). Idempotent."""
        proc = self._proc
        if proc is None:
            return
        self._stopping = True
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        log.info("stopped %s %s pid=%s", self.role, self.endpoint, proc.pid)

    def kill(self) -> None:
        """SIGKILL without marking the exit as expected (for tests and fault injection)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


# --- RPC worker --------------------------------------------------------------------------


class RpcWorker(_ChildProcess):
    """``ggml-rpc-server`` bound to one private IPv4 address."""

    role = "ggml-rpc-server"

    def __init__(
        self,
        binaries: RuntimeBinaries,
        host: str,
        port: int = DEFAULT_RPC_PORT,
        *,
        log_dir: Path,
        threads: int | None = None,
        use_cache: bool = False,
        allow_public: bool = False,
        on_exit: ExitCallback | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir, on_exit=on_exit, env=env)
        if not 0 < port < 65536:
            raise ValueError(f"invalid RPC port {port}")
        if threads is not None and threads < 1:
            raise ValueError(f"invalid thread count {threads}")
        self.binaries = binaries
        self.host = validate_rpc_bind_host(host, allow_public=allow_public)
        self.port = port
        self.threads = threads
        self.use_cache = use_cache

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [str(self.binaries.rpc_server), "--host", self.host, "--port", str(self.port)]
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.use_cache:
            argv.append("--cache")
        return argv

    def start(self, timeout: float = 30.0) -> None:
        """Start and wait until the worker accepts TCP connections."""
        if self.alive:
            return
        if not port_is_free(self.host, self.port):
            raise PortInUseError(f"cannot start ggml-rpc-server: {self.endpoint} is already in use")
        self._spawn(self.argv(), f"rpc-worker-{self.host}-{self.port}.log")
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                raise self._start_failure(f"{describe_exit(self.exit_code)} during startup")
            if probe_tcp(self.host, self.port, timeout=0.5):
                # a probe answered by someone else would race our bind; make sure we are alive
                time.sleep(0.05)
                if self.alive:
                    return
                continue
            if time.monotonic() >= deadline:
                self.stop()
                raise self._start_failure(f"did not accept connections within {timeout:.0f}s")
            time.sleep(0.1)


# --- llama-server ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    """Everything that makes one ``llama-server`` instance; equal specs share a warm server.

    ``rpc_endpoints`` lists ``host:port`` of RPC workers; ``tensor_split`` gives one proportion
    per RPC worker, in the same order (on a CPU-only primary the workers are the only offload
    devices). ``n_gpu_layers`` defaults to all layers (99) when RPC is used, so every repeating
    layer, the output layer and the KV cache live on the workers and the primary keeps only the
    token embeddings; a smaller number keeps the first layers on the primary's CPU. Without RPC
    llama.cpp's default applies. ``ctx_size`` is the total KV size shared by ``parallel`` slots.
    """

    model_path: str
    ctx_size: int = DEFAULT_CTX_SIZE
    rpc_endpoints: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    n_gpu_layers: int | None = None
    parallel: int = 1
    threads: int | None = None
    alias: str | None = None
    extra_args: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_path", str(Path(self.model_path).expanduser().resolve()))
        object.__setattr__(self, "rpc_endpoints", tuple(self.rpc_endpoints))
        object.__setattr__(self, "tensor_split", tuple(float(x) for x in self.tensor_split))
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        if self.ctx_size < 1:
            raise ValueError(f"ctx_size must be positive, got {self.ctx_size}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {self.parallel}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        for endpoint in self.rpc_endpoints:
            parse_endpoint(endpoint)
        if len(set(self.rpc_endpoints)) != len(self.rpc_endpoints):
            raise ValueError("rpc_endpoints must be distinct")
        if self.tensor_split:
            if not self.rpc_endpoints:
                raise ValueError("tensor_split needs rpc_endpoints")
            if len(self.tensor_split) != len(self.rpc_endpoints):
                raise ValueError(
                    f"tensor_split has {len(self.tensor_split)} entries for "
                    f"{len(self.rpc_endpoints)} RPC workers"
                )
            if any(x < 0 for x in self.tensor_split) or sum(self.tensor_split) <= 0:
                raise ValueError("tensor_split proportions must be >= 0 with a positive sum")

    def argv(
        self, binary: Path, host: str, port: int, verbosity: int = DEFAULT_SERVER_VERBOSITY
    ) -> list[str]:
        argv = [str(binary), "--model", self.model_path, "--ctx-size", str(self.ctx_size)]
        argv += ["--host", host, "--port", str(port), "--parallel", str(self.parallel)]
        # The plan decides context, layers and split; don't let --fit second-guess it.
        argv += ["--fit", "off", "--no-webui", "--log-verbosity", str(verbosity)]
        if self.parallel > 1:
            argv.append("--kv-unified")
        if self.threads is not None:
            argv += ["--threads", str(self.threads)]
        if self.alias:
            argv += ["--alias", self.alias]
        if self.rpc_endpoints:
            argv += ["--rpc", ",".join(self.rpc_endpoints)]
        layers = self.n_gpu_layers
        if layers is None and self.rpc_endpoints:
            layers = RPC_DEFAULT_GPU_LAYERS
        if layers is not None:
            argv += ["--n-gpu-layers", str(layers)]
        if self.tensor_split:
            argv += ["--tensor-split", ",".join(f"{x:g}" for x in self.tensor_split)]
        argv += list(self.extra_args)
        return argv


@dataclass(frozen=True)
class ChatRequest:
    """The generation parameters the agent forwards to llama-server."""

    messages: Sequence[Mapping[str, Any]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Sequence[str] | str | None = None
    seed: int | None = None

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [dict(message) for message in self.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        optional = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        if self.stop is not None:
            body["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return body


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Timings:
    """llama-server's own measurements for one request."""

    prompt_tokens: int
    prompt_ms: float
    predicted_tokens: int
    predicted_ms: float
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def tokens_per_second(self) -> float:
        return self.predicted_tokens * 1000.0 / self.predicted_ms if self.predicted_ms else 0.0

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Timings:
        return cls(
            prompt_tokens=int(data.get("prompt_n", 0)),
            prompt_ms=float(data.get("prompt_ms", 0.0)),
            predicted_tokens=int(data.get("predicted_n", 0)),
            predicted_ms=float(data.get("predicted_ms", 0.0)),
            raw=dict(data),
        )


@dataclass(frozen=True)
class ChatDelta:
    """One streamed piece: new text, and on the last pieces finish reason, usage, timings."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


class LlamaServer(_ChildProcess):
    """``llama-server`` for one :class:`ServerSpec` on a free loopback port."""

    role = "llama-server"

    def __init__(
        self,
        binaries: RuntimeBinaries,
        spec: ServerSpec,
        *,
        log_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        verbosity: int = DEFAULT_SERVER_VERBOSITY,
        on_exit: ExitCallback | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir, on_exit=on_exit, env=env)
        self.verbosity = verbosity
        address = ipaddress.ip_address(host)
        if address.is_unspecified:
            raise UnsafeBindError("llama-server is for the local agent only; bind 127.0.0.1")
        self.binaries = binaries
        self.spec = spec
        self.host = host
        self._fixed_port = port
        self.port = port or 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def health(self, timeout: float = 2.0) -> bool:
        """True when ``/health`` answers 200 (the model is loaded)."""
        try:
            response = httpx.get(f"{self.base_url}/health", timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def start(self, timeout: float = 180.0) -> None:
        """Start and wait until ``/health`` is OK; retries a port lost to a race."""
        if self.alive:
            return
        model = Path(self.spec.model_path)
        if not model.is_file():
            raise RuntimeMissingError(f"model file not found: {model}")
        attempts = 1 if self._fixed_port else 3
        for attempt in range(1, attempts + 1):
            self.port = self._fixed_port or free_loopback_port(self.host)
            if self._fixed_port and not port_is_free(self.host, self.port):
                raise PortInUseError(f"cannot start llama-server: {self.endpoint} is in use")
            argv = self.spec.argv(self.binaries.llama_server, self.host, self.port, self.verbosity)
            self._spawn(argv, "llama-server.log")
            try:
                self._wait_healthy(timeout)
                return
            except RuntimeStartError as exc:
                bind_lost = any("bind" in line.lower() for line in exc.stderr_tail)
                if attempt == attempts or not bind_lost:
                    raise
                log.warning("llama-server lost port %s to another process; retrying", self.port)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.alive:
                    raise self._start_failure(f"{describe_exit(self.exit_code)} during startup")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    self.stop()
                    raise self._start_failure(f"was not healthy within {timeout:.0f}s")
                time.sleep(0.2)

    async def stream_chat(
        self,
        request: ChatRequest,
        *,
        client: httpx.AsyncClient | None = None,
        read_timeout: float = 300.0,
    ) -> AsyncGenerator[ChatDelta, None]:
        """Stream ``/v1/chat/completions`` as :class:`ChatDelta` items while they arrive.

        Closing the generator (``aclose()``, ``break`` in ``async for`` plus garbage
        collection, or cancelling the consuming task) closes the HTTP connection, which makes
        llama-server stop generating for this request.
        """
        self.check()
        timeout = httpx.Timeout(connect=5.0, read=read_timeout, write=30.0, pool=30.0)
        owned = client is None
        http = client if client is not None else httpx.AsyncClient(timeout=timeout)
        url = f"{self.base_url}/v1/chat/completions"
        try:
            async with http.stream("POST", url, json=request.payload(), timeout=timeout) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", errors="replace")
                    raise GenerationError(
                        f"llama-server returned {resp.status_code}: {_error_message(body)}",
                        status_code=resp.status_code,
                    )
                async for line in resp.aiter_lines():
                    delta = _parse_sse_line(line)
                    if delta is _DONE:
                        return
                    if isinstance(delta, ChatDelta):
                        yield delta
            raise await self._stream_broken("stream ended without [DONE]")
        except httpx.HTTPError as exc:
            raise await self._stream_broken(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if owned:
                await asyncio.shield(http.aclose())

    async def _stream_broken(self, reason: str) -> LlamaRuntimeError:
        # A crash shows up as a broken stream just before the exit: give the process a moment
        # (an abort can take a while to finish writing its report).
        for _ in range(40):
            if not self.alive:
                break
            await asyncio.sleep(0.05)
        if self._proc is not None and not self.alive and not self._stopping:
            return self._exit_info(self._proc.returncode).error()
        return GenerationError(f"llama-server stream failed: {reason}")


class _Done:
    pass


_DONE = _Done()


def _parse_sse_line(line: str) -> ChatDelta | _Done | None:
    if not line.startswith("data:"):
        return None  # blank separators, ": ping" comments, event: lines
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        chunk = json.loads(data)
    except ValueError:
        raise GenerationError(f"llama-server sent malformed stream data: {data[:200]}") from None
    if not isinstance(chunk, dict):
        return None
    if "error" in chunk:
        raise GenerationError(f"llama-server aborted the stream: {_error_message(chunk)}")
    text = ""
    finish_reason: str | None = None
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        finish_reason = choice.get("finish_reason") or finish_reason
    usage_json = chunk.get("usage")
    usage = None
    if isinstance(usage_json, dict):
        usage = Usage(
            prompt_tokens=int(usage_json.get("prompt_tokens", 0)),
            completion_tokens=int(usage_json.get("completion_tokens", 0)),
            total_tokens=int(usage_json.get("total_tokens", 0)),
        )
    timings_json = chunk.get("timings")
    timings = Timings.from_json(timings_json) if isinstance(timings_json, dict) else None
    if not text and finish_reason is None and usage is None and timings is None:
        return None
    return ChatDelta(text=text, finish_reason=finish_reason, usage=usage, timings=timings)


def _error_message(body: str | Mapping[str, Any]) -> str:
    data: Any = body
    if isinstance(body, str):
        try:
            data = json.loads(body)
        except ValueError:
            return body.strip()[:300] or "(empty body)"
    if isinstance(data, Mapping):
        error = data.get("error", data)
        if isinstance(error, Mapping):
            return str(error.get("message") or error)
        return str(error)
    return str(data)[:300]


# --- manager -----------------------------------------------------------------------------


class RuntimeManager:
    """Owns the agent's llama.cpp children: one warm ``llama-server`` and local RPC workers."""

    def __init__(
        self,
        binaries: RuntimeBinaries,
        log_dir: str | os.PathLike[str],
        *,
        on_exit: ExitCallback | None = None,
        server_host: str = "127.0.0.1",
        start_timeout: float = 180.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.binaries = binaries
        self.log_dir = Path(log_dir)
        self._on_exit = on_exit
        self._server_host = server_host
        self._start_timeout = start_timeout
        self._env = dict(env) if env else None
        self._server: LlamaServer | None = None
        self._workers: dict[tuple[str, int], RpcWorker] = {}
        # Separate locks: starting a worker must not wait for a model to load.
        self._server_lock = threading.Lock()
        self._workers_lock = threading.Lock()
        self._closed = False

    @property
    def server(self) -> LlamaServer | None:
        return self._server

    @property
    def rpc_workers(self) -> dict[str, RpcWorker]:
        with self._workers_lock:
            return {worker.endpoint: worker for worker in self._workers.values()}

    def ensure_server(self, spec: ServerSpec) -> LlamaServer:
        """Return the running server for ``spec``, or (re)start one. Blocks until healthy."""
        with self._server_lock:
            if self._closed:
                raise LlamaRuntimeError("runtime manager is closed")
            current = self._server
            if current is not None and current.spec == spec and current.alive:
                return current
            if current is not None:
                reason = "spec changed" if current.spec != spec else "it exited"
                log.info("restarting llama-server (%s)", reason)
                current.stop()
                self._server = None
            server = LlamaServer(
                self.binaries,
                spec,
                log_dir=self.log_dir,
                host=self._server_host,
                on_exit=self._on_exit,
                env=self._env,
            )
            server.start(timeout=self._start_timeout)
            self._server = server
            return server

    async def ensure_server_async(self, spec: ServerSpec) -> LlamaServer:
        return await asyncio.to_thread(self.ensure_server, spec)

    def stop_server(self) -> None:
        with self._server_lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def start_rpc_worker(
        self,
        host: str,
        port: int = DEFAULT_RPC_PORT,
        *,
        threads: int | None = None,
        allow_public: bool = False,
        timeout: float = 30.0,
    ) -> RpcWorker:
        """Start (or return the already running) RPC worker on ``host:port``."""
        bind_host = validate_rpc_bind_host(host, allow_public=allow_public)
        with self._workers_lock:
            if self._closed:
                raise LlamaRuntimeError("runtime manager is closed")
            key = (bind_host, port)
            existing = self._workers.get(key)
            if existing is not None and existing.alive:
                return existing
            worker = RpcWorker(
                self.binaries,
                bind_host,
                port,
                log_dir=self.log_dir,
                threads=threads,
                allow_public=allow_public,
                on_exit=self._on_exit,
                env=self._env,
            )
            worker.start(timeout=timeout)
            self._workers[key] = worker
            return worker

    def stop_rpc_worker(self, host: str, port: int = DEFAULT_RPC_PORT) -> bool:
        """Stop the worker on ``host:port``; False if there was none."""
        with self._workers_lock:
            worker = self._workers.pop(
                (validate_rpc_bind_host(host, allow_public=True), port), None
            )
        if worker is None:
            return False
        worker.stop()
        return True

    def close(self) -> None:
        """Stop the server first (it holds connections to the workers), then the workers."""
        self._closed = True
        with self._server_lock:
            server, self._server = self._server, None
            if server is not None:
                server.stop()
        with self._workers_lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.stop()

    def __enter__(self) -> RuntimeManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
