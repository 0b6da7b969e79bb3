"""An emulated LAN for the benchmarks: ``ggml-rpc-server`` workers in network namespaces of
their own, each behind a veth link shaped like 1 GbE.

:class:`EmulatedLan` gives worker ``i`` a namespace ``dacp-lan-<pid>-<i>`` and a veth pair with a
private test-only /30 out of 10.99.0.0/16 (``.1`` on the host side, ``.2`` inside; a block that
overlaps an address or route of this machine is never used), shapes both ends with ``tbf`` to
the link rate, and starts the worker in the namespace with ``ip netns exec``. With an added
round-trip time, a :mod:`bench.delay_proxy` in the namespace listens on the namespace's address
and forwards to the worker on the namespace's own loopback, half the RTT each way (the proxy's
own user-space hop adds some 0.05-0.15 ms more). Either way the host reaches worker ``i`` at
``10.99.x.2:50052``, and every byte crosses the shaped link.

Each worker has a link of its own (as behind a switch, though there the primary's one port
would be shared): llama.cpp's RPC backends compute one after another, so the links are rarely
busy at the same time.

Leaving the context, on an error, Ctrl+C or SIGTERM too, stops the processes and deletes the
veths and namespaces; namespaces a killed run left behind (its pid gone) are deleted on entry.
Needs root and iproute2 (``ip``, ``tc``): :func:`unavailable_reason` says why not, and
:class:`LanUnavailable` is raised when the plumbing cannot be built.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.managed_child import ManagedChild, describe_exit
from agent.runtime.rpc_worker import RpcWorker

NAMESPACE_PREFIX = "dacp-lan-"
SUBNET = ipaddress.IPv4Network("10.99.0.0/16")
WORKER_PORT = 50052
#: The worker's port on the namespace's loopback when a delay proxy holds ``WORKER_PORT``.
BEHIND_PROXY_PORT = 50053
_COMMAND_TIMEOUT_S = 15.0
_REPO_ROOT = Path(__file__).resolve().parent.parent
_TCP_LISTEN = "0A"


class LanUnavailable(RuntimeError):
    """The emulated LAN cannot be built here (no root, no iproute2, a command refused)."""


@dataclass(frozen=True)
class LinkShape:
    """What each emulated link looks like: ``tbf`` rate, bucket and queue bound on both ends
    of the veth, and the round-trip time the delay proxies add (0: no proxy)."""

    rate: str = "1gbit"
    burst: str = "128kb"
    queue_latency: str = "10ms"
    rtt_ms: float = 0.2

    def tbf(self) -> list[str]:
        return ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.queue_latency]

    def describe(self) -> str:
        delay = f", +{self.rtt_ms:g} ms RTT" if self.rtt_ms > 0 else ", no added delay"
        return f"tbf {self.rate} (burst {self.burst}, queue <= {self.queue_latency}){delay}"


@dataclass(frozen=True)
class Link:
    """One worker's namespace and veth pair."""

    namespace: str
    host_veth: str
    peer_veth: str
    network: ipaddress.IPv4Network  # a /30: .1 the host's end, .2 the namespace's

    @property
    def host_address(self) -> str:
        return str(self.network[1])

    @property
    def peer_address(self) -> str:
        return str(self.network[2])


def unavailable_reason(
    euid: int | None = None, which: Callable[[str], str | None] = shutil.which
) -> str | None:
    """Why this machine cannot build the LAN (None: it can, as far as can be told up front)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    uid = os.geteuid() if euid is None else euid
    if uid != 0:
        return f"needs root for ip netns and tc (running as uid {uid})"
    missing = [tool for tool in ("ip", "tc") if which(tool) is None]
    if missing:
        return f"needs iproute2: {' and '.join(missing)} not found on PATH"
    return None


def plan_links(count: int, owner_pid: int, taken: Iterable[ipaddress.IPv4Network]) -> list[Link]:
    """``count`` links named after ``owner_pid``, on /30 blocks of :data:`SUBNET` that overlap
    none of ``taken`` (the machine's addresses and routes)."""
    taken = list(taken)
    blocks = list(SUBNET.subnets(new_prefix=30))
    start = (owner_pid * 8) % len(blocks)  # concurrent runs start far apart
    free = (
        block
        for block in blocks[start:] + blocks[:start]
        if not any(block.overlaps(net) for net in taken)
    )
    links = []
    for index in range(count):
        network = next(free, None)
        if network is None:
            raise LanUnavailable(f"no free /30 left in {SUBNET} (it is in use on this machine)")
        veth = f"dl{owner_pid}-{index}"  # at most 12 of the 15 characters a name may have
        links.append(
            Link(f"{NAMESPACE_PREFIX}{owner_pid}-{index}", f"{veth}h", f"{veth}n", network)
        )
    return links


def setup_commands(link: Link, shape: LinkShape) -> list[list[str]]:
    """The namespace, the veth pair with its addresses, and ``tbf`` on both of its ends."""
    ns, prefix = link.namespace, link.network.prefixlen
    peer = ["peer", "name", link.peer_veth, "netns", ns]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "link", "add", link.host_veth, "type", "veth", *peer],
        ["ip", "addr", "add", f"{link.host_address}/{prefix}", "dev", link.host_veth],
        ["ip", "link", "set", link.host_veth, "up"],
        ["ip", "-n", ns, "addr", "add", f"{link.peer_address}/{prefix}", "dev", link.peer_veth],
        ["ip", "-n", ns, "link", "set", link.peer_veth, "up"],
        ["tc", "qdisc", "add", "dev", link.host_veth, "root", *shape.tbf()],
        ["tc", "-n", ns, "qdisc", "add", "dev", link.peer_veth, "root", *shape.tbf()],
    ]


def teardown_commands(link: Link) -> list[list[str]]:
    """Deleting the namespace deletes the veth's inner end, and with it the pair (the host end
    is deleted too, in case the namespace never got it)."""
    return [["ip", "link", "del", link.host_veth], ["ip", "netns", "del", link.namespace]]


def namespace_names(ip_netns_list: str) -> list[str]:
    """The names in ``ip netns list`` output (lines ``name`` or ``name (id: N)``)."""
    return [line.split()[0] for line in ip_netns_list.splitlines() if line.strip()]


def stale_namespaces(names: Iterable[str], pid_alive: Callable[[int], bool]) -> list[str]:
    """Our namespaces (``dacp-lan-<pid>-<i>``) whose run is gone."""
    stale = []
    for name in names:
        owner, _, index = name.removeprefix(NAMESPACE_PREFIX).partition("-")
        if name.startswith(NAMESPACE_PREFIX) and owner.isdigit() and index.isdigit():
            if not pid_alive(int(owner)):
                stale.append(name)
    return stale


def listening_ports(proc_net_tcp: str) -> set[int]:
    """Local ports in LISTEN state in ``/proc/<pid>/net/tcp`` text (the pid's namespace)."""
    ports = set()
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == _TCP_LISTEN:
            ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(argv: Sequence[str], *, check: bool = True) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise LanUnavailable(f"{shlex.join(argv)}: {exc}") from exc
        return ""
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise LanUnavailable(f"{shlex.join(argv)}: {detail[-1] if detail else done.returncode}")
    return done.stdout


def _taken_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to (but the default)."""
    taken = []
    for line in _run(["ip", "-4", "-o", "addr", "show"]).splitlines():
        fields = line.split()
        if "inet" in fields:
            with contextlib.suppress(ValueError, IndexError):
                taken.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    for line in _run(["ip", "-4", "route", "show", "table", "all"]).splitlines():
        fields = line.split()
        if fields and fields[0] in ("local", "broadcast", "unicast", "blackhole", "unreachable"):
            fields = fields[1:]
        with contextlib.suppress(ValueError, IndexError):
            if fields[0] != "default":
                taken.append(ipaddress.IPv4Network(fields[0], strict=False))
    return taken


class NamespacedChild(ManagedChild):
    """A child process run in a network namespace (``ip netns exec``, which execs the command:
    the pid is the command's), ready once its namespace has ``port`` listening."""

    def __init__(
        self,
        role: str,
        namespace: str,
        argv: Sequence[str],
        *,
        port: int,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir, on_exit=None, env=env)
        self.role = role
        self.namespace = namespace
        self.command = list(argv)
        self.port = port

    @property
    def endpoint(self) -> str:
        return f"{self.namespace}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self._spawn(
            ["ip", "netns", "exec", self.namespace, *self.command],
            f"{self.role}-{self.namespace}.log",
        )
        deadline = time.monotonic() + timeout
        while not self._listening():
            if not self.alive:
                raise self._start_failure(f"{describe_exit(self.exit_code)} during startup")
            if time.monotonic() >= deadline:
                self.stop()
                raise self._start_failure(f"did not listen within {timeout:.0f}s")
            time.sleep(0.1)

    def _listening(self) -> bool:
        try:
            return self.port in listening_ports(Path(f"/proc/{self.pid}/net/tcp").read_text())
        except OSError:
            return False


class EmulatedLan:
    """``count`` emulated links, each with a namespace for one RPC worker (context manager)."""

    def __init__(self, count: int, shape: LinkShape, log_dir: Path) -> None:
        self.count = count
        self.shape = shape
        self.log_dir = log_dir
        self.links: list[Link] = []
        self.children: list[NamespacedChild] = []
        self._built: list[Link] = []
        self._previous_sigterm: Callable[[int, FrameType | None], object] | int | None
        self._previous_sigterm = None

    def __enter__(self) -> EmulatedLan:
        reason = unavailable_reason()
        if reason is not None:
            raise LanUnavailable(reason)
        self._catch_sigterm()
        try:
            listed = _run(["ip", "netns", "list"])
            for name in stale_namespaces(namespace_names(listed), _pid_alive):
                _run(["ip", "netns", "del", name], check=False)
            self.links = plan_links(self.count, os.getpid(), _taken_networks())
            for link in self.links:
                self._built.append(link)
                for argv in setup_commands(link, self.shape):
                    _run(argv)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start_rpc_worker(
        self, index: int, binaries: RuntimeBinaries, *, threads: int | None
    ) -> str:
        """Start worker ``index`` (behind its delay proxy, with an RTT) and return the
        ``host:port`` the host reaches it at."""
        link = self.links[index]
        delayed = self.shape.rtt_ms > 0
        bind = ("127.0.0.1", BEHIND_PROXY_PORT) if delayed else (link.peer_address, WORKER_PORT)
        worker = RpcWorker(binaries, bind[0], bind[1], log_dir=self.log_dir, threads=threads)
        self._start(
            NamespacedChild(
                "rpc-worker", link.namespace, worker.argv(), port=bind[1], log_dir=self.log_dir
            )
        )
        if delayed:
            proxy = [sys.executable, "-m", "bench.delay_proxy"]
            proxy += [
                "--listen",
                f"{link.peer_address}:{WORKER_PORT}",
                "--to",
                ":".join(map(str, bind)),
            ]
            proxy += ["--delay-ms", f"{self.shape.rtt_ms / 2:g}"]
            self._start(
                NamespacedChild(
                    "delay-proxy",
                    link.namespace,
                    proxy,
                    port=WORKER_PORT,
                    log_dir=self.log_dir,
                    env={"PYTHONPATH": str(_REPO_ROOT)},
                )
            )
        return f"{link.peer_address}:{WORKER_PORT}"

    def _start(self, child: NamespacedChild) -> None:
        self.children.append(child)
        child.start()

    def close(self) -> None:
        """Stop the processes, delete the links. Idempotent; never raises."""
        for child in reversed(self.children):
            with contextlib.suppress(Exception):
                child.stop(grace=3.0)
        self.children.clear()
        for link in reversed(self._built):
            for argv in teardown_commands(link):
                _run(argv, check=False)
        self._built.clear()
        self._restore_sigterm()

    def _catch_sigterm(self) -> None:
        """SIGTERM unwinds like Ctrl+C (so the links are deleted), while the LAN is up."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # someone else handles it

        def terminate(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, terminate)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def describe(self) -> dict[str, object]:
        return {
            "shape": self.shape.describe(),
            "links": [
                {
                    "namespace": link.namespace,
                    "host_veth": f"{link.host_veth} {link.host_address}/{link.network.prefixlen}",
                    "worker": f"{link.peer_address}:{WORKER_PORT}",
                }
                for link in self.links
            ],
        }
