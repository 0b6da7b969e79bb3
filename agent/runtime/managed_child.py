"""One llama.cpp child process: spawn (tied to the agent, see ``agent/runtime/child_process.py``),
log capture with rotation, stop, and crash detection reported to an ``on_exit`` callback from a
watcher thread. An ``atexit`` hook stops whatever is still running."""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.runtime.child_process import spawn_tied_to_agent
from agent.runtime.runtime_errors import (
    RUN_MARKER,
    LlamaRuntimeError,
    RuntimeCrashedError,
    RuntimeStartError,
)

log = logging.getLogger(__name__)

_TAIL_BYTES = 64 * 1024
_STOP_GRACE_SECONDS = 5.0
# Settings a parent shell could leak into llama.cpp via environment variables; the spec decides.
_SCRUBBED_ENV_PREFIXES = ("LLAMA_ARG_",)
# On abort ggml attaches gdb to print a backtrace: slow, and it buries the real error line.
_DEFAULT_CHILD_ENV = {"GGML_NO_BACKTRACE": "1"}
_LOG_ROTATE_BYTES = 16 * 1024 * 1024

_LIVE: set[ManagedChild] = set()
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


class ManagedChild:
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
            log_file.write(f"{RUN_MARKER}{stamp} starting: {shlex.join(argv)}\n".encode())
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
