"""What the agent's llama.cpp build says of itself: its version, its RPC protocol version and
the devices it can compute on, read from the binaries themselves.

- ``llama-server --list-devices`` prints ``Available devices:`` and one line per device that is
  not the CPU, ``  CUDA0: NVIDIA H100 80GB HBM3 (81090 MiB, 80542 MiB free)`` (``  (none)``
  in a CPU build); with ``--rpc HOST:PORT`` before it, each RPC server is a device too
  (``  RPC0: 127.0.0.1:50052 (24151 MiB, 24151 MiB free)``).
- ``llama-server --version`` prints ``version: <version>`` on stderr.
- ``ggml-rpc-server`` prints ``Starting RPC server v7.0.0`` and its ``Devices:`` (same line
  format) when it starts. Its output is block-buffered on a pipe, so it is started on a port
  this module holds already: it prints its banner, fails to bind, and exits, flushing it
  (:func:`read_rpc_banner`). It never serves.

Parsers are pure functions of the text; runners have a timeout (:data:`PROBE_TIMEOUT`) and
turn every failure into an empty answer and a warning, never an exception. A
:class:`LlamaProbe` runs them once per build (binary paths, sizes and modification times).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.runtime.llama_binaries import BUILD_STAMP_NAME, RuntimeBinaries
from agent.runtime.managed_child import _child_env as child_env
from common.contract import MIB as MIB  # re-exported: the unit llama.cpp lists devices in

log = logging.getLogger(__name__)

#: Seconds any one llama.cpp binary may take to answer.
PROBE_TIMEOUT = 10.0

LIST_HEADER = "Available devices:"
RPC_DEVICES_HEADER = "Devices:"
#: ``  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)``; the name ends at the first ": " (an old
#: build's RPC device is ``RPC[127.0.0.1:50052]``), the description may hold parentheses.
_DEVICE_LINE = re.compile(
    r"^\s*(?P<name>\S+?): (?P<description>.*?)\s*"
    r"\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$"
)
_VERSION_LINE = re.compile(r"^\s*version:\s*(?P<version>\S.*?)\s*$", re.M)
_RPC_BANNER = re.compile(r"Starting RPC server v(?P<protocol>\d+\.\d+\.\d+)")


@dataclass(frozen=True, slots=True)
class ListedDevice:
    """A device as a llama.cpp binary lists it (memory in whole MiB, as printed)."""

    name: str
    description: str
    memory_total_bytes: int
    memory_free_bytes: int


@dataclass(frozen=True, slots=True)
class RpcBanner:
    """What ``ggml-rpc-server`` says when it starts: its protocol version and its devices."""

    protocol: str
    devices: tuple[ListedDevice, ...]


@dataclass(frozen=True, slots=True)
class LlamaRuntime:
    """The agent's llama.cpp build as it describes itself ("" / () where it did not say)."""

    backend: str
    version: str
    rpc_protocol: str
    #: ``llama-server --list-devices``: every device but the host CPU, in llama.cpp's order.
    devices: tuple[ListedDevice, ...]


# --- parsers -----------------------------------------------------------------------------


def parse_device_line(line: str) -> ListedDevice | None:
    """One ``NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)`` line, or None for any other."""
    match = _DEVICE_LINE.match(line)
    if match is None:
        return None
    return ListedDevice(
        name=match["name"],
        description=match["description"],
        memory_total_bytes=int(match["total"]) * MIB,
        memory_free_bytes=int(match["free"]) * MIB,
    )


def _devices_after(header: str, text: str) -> tuple[ListedDevice, ...]:
    lines = iter(text.splitlines())
    for line in lines:
        if line.strip() == header:
            break
    else:
        return ()
    return tuple(d for d in map(parse_device_line, lines) if d is not None)


def parse_list_devices(text: str) -> tuple[ListedDevice, ...]:
    """The devices of ``llama-server --list-devices`` output (``(none)``: none)."""
    return _devices_after(LIST_HEADER, text)


def parse_version(text: str) -> str:
    """``llama-server --version``'s version (``version: 4567 (abc1234)`` → ``4567
    (abc1234)``), or ""."""
    match = _VERSION_LINE.search(text)
    return match["version"] if match else ""


def parse_rpc_banner(text: str) -> RpcBanner:
    """The protocol version and devices of ``ggml-rpc-server``'s start banner ("" / ())."""
    match = _RPC_BANNER.search(text)
    return RpcBanner(
        protocol=match["protocol"] if match else "",
        devices=_devices_after(RPC_DEVICES_HEADER, text),
    )


# --- runners -----------------------------------------------------------------------------


def _run(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
    """The finished command, or None (and a warning) when it could not run or took too long."""
    try:
        return subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            env=child_env(None),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.warning("%s took more than %.0f s; ignoring its answer", " ".join(command), timeout)
    except OSError as exc:
        log.warning("cannot run %s: %s", command[0], exc)
    return None


def list_devices(
    llama_server: Path, rpc_servers: Sequence[str] = (), timeout: float = PROBE_TIMEOUT
) -> tuple[ListedDevice, ...]:
    """``llama-server [--rpc HOST:PORT,...] --list-devices``: the build's devices, and one per
    RPC server named (``--rpc`` must come first: ``--list-devices`` exits where it is read)."""
    command = [str(llama_server)]
    if rpc_servers:
        command += ["--rpc", ",".join(rpc_servers)]
    result = _run([*command, "--list-devices"], timeout)
    if result is None:
        return ()
    if result.returncode != 0 or LIST_HEADER not in result.stdout:
        _warn(f"{llama_server} --list-devices failed", result)
        return ()
    return parse_list_devices(result.stdout)


def read_version(llama_server: Path, timeout: float = PROBE_TIMEOUT) -> str:
    """``llama-server --version``'s version, or "" (and a warning)."""
    result = _run([str(llama_server), "--version"], timeout)
    if result is None:
        return ""
    version = parse_version(result.stderr) or parse_version(result.stdout)
    if not version:
        _warn(f"{llama_server} --version named no version", result)
    return version


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    """A loopback port this process listens on (exclusively, on Windows too) while inside."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        if sys.platform == "win32":  # else another socket with SO_REUSEADDR could take it
            held.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        yield int(held.getsockname()[1])


def read_rpc_banner(rpc_server: Path, timeout: float = PROBE_TIMEOUT) -> RpcBanner:
    """``ggml-rpc-server``'s start banner, or an empty one (and a warning).

    It is started on a loopback port held here, so it prints its banner, cannot bind and
    exits (its stdout is flushed at exit; a pipe gets nothing from a server still running)."""
    try:
        with _held_port() as port:
            result = _run([str(rpc_server), "-H", "127.0.0.1", "-p", str(port)], timeout)
    except OSError as exc:
        log.warning("cannot hold a loopback port to start %s: %s", rpc_server, exc)
        return RpcBanner("", ())
    if result is None:
        return RpcBanner("", ())
    banner = parse_rpc_banner(result.stdout)
    if not banner.protocol:
        _warn(f"{rpc_server} named no RPC protocol version", result)
    return banner


def _warn(what: str, result: subprocess.CompletedProcess[str]) -> None:
    """Logs that a probe told nothing usable: ``what``, its exit code and its last line."""
    log.warning(
        "%s (exit code %d): %s", what, result.returncode, _last_line(result.stderr or result.stdout)
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


# --- one probe per build -----------------------------------------------------------------


def _stamp(path: Path) -> tuple[str, int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (str(path), -1, -1)
    return (str(path), stat.st_mtime_ns, stat.st_size)


class LlamaProbe:
    """Asks a build for its version, RPC protocol and devices once, and answers again from
    memory until a binary changes (path, size or modification time). Thread-safe."""

    def __init__(self, timeout: float = PROBE_TIMEOUT) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._key: tuple[object, ...] | None = None
        self._runtime: LlamaRuntime | None = None
        #: How many times the binaries were asked (tests).
        self.probes = 0

    def runtime(self, binaries: RuntimeBinaries) -> LlamaRuntime:
        key = (_stamp(binaries.llama_server), _stamp(binaries.rpc_server), binaries.backend)
        with self._lock:
            if self._runtime is None or key != self._key:
                self._runtime = probe(binaries, self.timeout)
                self._key = key
                self.probes += 1
            return self._runtime


def stamped_version(version: str, bin_dir: Path) -> str:
    """A build from a source archive knows no build number (``0.6.0-dev (build 0, commit
    unknown)``); ``python -m ops.build_llama`` wrote which release it built beside it."""
    if version and "build 0" not in version:
        return version
    try:
        stamp = json.loads((bin_dir / BUILD_STAMP_NAME).read_text(encoding="utf-8"))
        release = f"{stamp['dist']} {stamp['version']}"
    except (OSError, ValueError, KeyError, TypeError):
        return version
    return f"{release} ({version})" if version else release


def probe(binaries: RuntimeBinaries, timeout: float = PROBE_TIMEOUT) -> LlamaRuntime:
    """Asks the build now (three short runs; each failure leaves its part empty)."""
    runtime = LlamaRuntime(
        backend=binaries.backend,
        version=stamped_version(read_version(binaries.llama_server, timeout), binaries.bin_dir),
        rpc_protocol=read_rpc_banner(binaries.rpc_server, timeout).protocol,
        devices=list_devices(binaries.llama_server, timeout=timeout),
    )
    log.info(
        "llama.cpp %s (%s backend, RPC protocol %s): %s",
        runtime.version or "of unknown version",
        runtime.backend,
        runtime.rpc_protocol or "unknown",
        ", ".join(f"{d.name} ({d.description})" for d in runtime.devices)
        or "no device but the CPU",
    )
    return runtime
