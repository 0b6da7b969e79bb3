"""A local cluster on this machine: one controller (embedded SQLite, in-process live state)
and two node agents, one holding the model (the primary) and one a pure RPC worker.

Each agent offers only ``--memory-limit`` to the scheduler, so the test model does not fit
on one node and every completion is split across both over llama.cpp RPC.

    python -m ops.local_cluster        # foreground until Ctrl-C; prints URL and keys

Shutdown is complete on SIGINT, SIGTERM and SIGHUP alike: the agents are stopped first (each
takes its llama.cpp children with it), then the controller, and the process exits 0. The
controller and agents run in sessions of their own, so a terminal's signals reach only this
process, which stops them in that order; on Linux each is also started with
``PR_SET_PDEATHSIG`` = SIGTERM, so even a SIGKILL of this process takes them down.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.contract import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_RPC_PORT
from ops import artifacts, paths

MODEL_NAME = "smollm2-135m"


@dataclass(frozen=True)
class ClusterModel:
    """The model a local cluster serves: its name in the API, its GGUF file and the file's
    sha256. The default is the test model (``ops.paths``)."""

    name: str
    path: Path
    sha256: str


def test_model() -> ClusterModel:
    return ClusterModel(MODEL_NAME, paths.model_path(), paths.MODEL_SHA256)


#: What each agent offers: small enough that SmolLM2-135M (≈227 MB with one 2,048-token slot
#: of KV cache and headroom) needs both, large enough that two together hold it with four
#: such slots (≈383 MB), so one llama-server serves four requests at once.
DEFAULT_MEMORY_LIMIT = 200 * 1024 * 1024


class ClusterError(RuntimeError):
    pass


class ShutdownRequested(BaseException):
    """SIGTERM or SIGHUP arrived; raised like KeyboardInterrupt so every ``with`` unwinds."""


#: Signals that stop the cluster cleanly (SIGINT arrives as KeyboardInterrupt).
SHUTDOWN_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def _raise_shutdown(signum: int, _frame: object) -> None:
    raise ShutdownRequested(signal.Signals(signum).name)


def install_shutdown_signals() -> None:
    """Make SIGTERM and SIGHUP unwind the main thread like Ctrl-C does, and make sure Ctrl-C
    does: a shell starts background jobs with SIGINT ignored, and Python then keeps it ignored.
    A SIGHUP ignored on purpose (``nohup``) stays ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in SHUTDOWN_SIGNALS:
        if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, _raise_shutdown)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP while the cluster stops, so a second one cannot cut the
    shutdown short; they are re-delivered (and ignored) afterwards."""
    mask = {signal.SIGINT, *SHUTDOWN_SIGNALS}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    try:
        yield
    finally:
        pending = signal.sigpending() & mask
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in pending}
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


#: Ports picked for the cluster come from below Linux's default ephemeral range (32768-60999):
#: an RPC worker binds its port only at its first job, and meanwhile any outgoing connection on
#: the machine could be handed a port from that range as its local port.
_PICKED_PORTS = range(20000, 32000)


def _free_port() -> int:
    for port in random.sample(_PICKED_PORTS, 200):
        if _port_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pick(port: int) -> int:
    """The default port when it is free, else any free one."""
    return port if port and _port_free(port) else _free_port()


@dataclass(frozen=True)
class AgentSpec:
    name: str
    rpc_port: int
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    holds_model: bool = False
    #: More agent flags (e.g. ``--llama-bin-dir DIR``: an operator's own llama.cpp build).
    extra_args: tuple[str, ...] = ()


DEFAULT_AGENTS = (
    AgentSpec("agent-a", DEFAULT_RPC_PORT, holds_model=True),
    AgentSpec("agent-b", DEFAULT_RPC_PORT + 10),
)


@dataclass
class ClusterConfig:
    var_dir: Path = Path("var/local-cluster")
    port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    agents: tuple[AgentSpec, ...] = DEFAULT_AGENTS
    database_url: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    ai_api_key: str = field(default_factory=lambda: os.environ.get("AI_API_KEY", ""))
    admin_api_key: str = field(default_factory=lambda: os.environ.get("ADMIN_API_KEY", ""))
    fresh: bool = True
    quiet: bool = False
    #: What it serves (None: the test model).
    model: ClusterModel | None = None
    #: The model goes into the controller's model store (``dacp models add``), and nodes that
    #: need it fetch it from there; no agent need hold it.
    store_model: bool = False
    #: The context per request the model is registered with (None: the registry's default).
    context_size: int | None = None


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class LocalCluster:
    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.procs: list[_Proc] = []
        self.ai_api_key = self.config.ai_api_key or secrets.token_urlsafe(24)
        self.admin_api_key = self.config.admin_api_key or secrets.token_urlsafe(24)
        self.secret = secrets.token_urlsafe(32)
        self.port = self.config.port
        self.grpc_port = self.config.grpc_port
        self.agent_procs: dict[str, _Proc] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _say(self, text: str) -> None:
        if not self.config.quiet:
            print(text, flush=True)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> _Proc:
        log = self.config.var_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = log.open("ab")
        if sys.platform == "linux":  # SIGTERM when this process dies, even by SIGKILL
            argv = [sys.executable, "-m", "ops.tied", str(os.getpid()), "--", *argv]
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own session: terminal signals reach only us, and we stop children in order.
            start_new_session=True,
        )
        handle.close()
        proc = _Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is not None:
                raise ClusterError(
                    f"{proc.name} exited with code {proc.popen.returncode}; its log "
                    f"({proc.log}) ends with:\n{proc.tail()}"
                )

    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_api_key}"}

    def _wait(self, what: str, check: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                value = check()
            except httpx.HTTPError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    @property
    def model(self) -> ClusterModel:
        return self.config.model or test_model()

    def start(self) -> LocalCluster:
        cfg = self.config
        served = self.model
        model = served.path
        if not model.exists():
            raise ClusterError(f"the model is missing at {model}: run `make model` first")
        if cfg.fresh and cfg.var_dir.exists():
            shutil.rmtree(cfg.var_dir)
        cfg.var_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.grpc_port = _pick(cfg.port), _pick(cfg.grpc_port)
        base_env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        controller_env = {
            **base_env,
            **cfg.extra_env,
            "DACP_VAR_DIR": str(cfg.var_dir / "controller"),
            # Its own config file (written at its first start): never the operator's.
            "DACP_CONFIG": str(cfg.var_dir / "controller" / "config.toml"),
            "DACP_URL": self.url,
            "PORT": str(self.port),
            "GRPC_PORT": str(self.grpc_port),
            # Agents learn the store's port with each transfer: any free one will do.
            "MODEL_STORE_PORT": os.environ.get("MODEL_STORE_PORT", "0"),
            "AI_API_KEY": self.ai_api_key,
            "ADMIN_API_KEY": self.admin_api_key,
            "NODE_ENROLLMENT_SECRET": self.secret,
        }
        if cfg.database_url:
            controller_env["DATABASE_URL"] = cfg.database_url
        store = "Postgres" if cfg.database_url else "embedded SQLite"
        self._say(f"starting controller on {self.url} (gRPC :{self.grpc_port}, {store})")
        self._spawn(
            "controller",
            [sys.executable, "-m", "interfaces.cli.main", "controller", "--log-level", "info"],
            controller_env,
        )
        self._wait(
            "the controller's /health",
            lambda: httpx.get(f"{self.url}/health", timeout=1).status_code == 200,
            60,
        )
        if cfg.store_model:
            self._say(f"adding {served.path.name} to the controller's model store")
            subprocess.run(
                [
                    *(sys.executable, "-m", "interfaces.cli.main", "models", "add"),
                    *(str(served.path), "--name", served.name),
                ],
                env=controller_env,
                check=True,
                capture_output=True,
            )
        for spec in cfg.agents:
            # One single-use token per agent; it names the controller's CA, which the agent
            # pins: the control channel runs over TLS here too.
            token = subprocess.run(
                [
                    *(sys.executable, "-m", "interfaces.cli.main", "token", "create"),
                    *("--ttl", "600", "--single-use", "--node-name", spec.name),
                ],
                env=controller_env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            self.start_agent(spec, token)

        def nodes_ready() -> bool:
            rows = httpx.get(f"{self.url}/api/admin/nodes", headers=self._admin(), timeout=2)
            data = rows.json()["data"]
            holds = any(m["sha256"] == served.sha256 for r in data for m in r["local_models"])
            ready = [r for r in data if r["state"] == "READY"]
            return len(ready) == len(cfg.agents) and (holds or cfg.store_model)

        self._wait("every agent to be READY with the model reported", nodes_ready, 120)
        if cfg.store_model:
            self._say(f"cluster ready: model {served.name} in the controller's model store")
            return self
        response = httpx.post(
            f"{self.url}/api/admin/models",
            headers=self._admin(),
            timeout=10,
            json={
                "name": served.name,
                "sha256": served.sha256,
                "file_name": served.path.name,
                **({"context_size": cfg.context_size} if cfg.context_size else {}),
            },
        )
        if response.status_code != 201:
            raise ClusterError(f"registering the model failed: {response.text}")
        self._say(f"cluster ready: model {served.name} registered")
        return self

    def start_agent(self, spec: AgentSpec, token: str) -> _Proc:
        cfg = self.config
        models_dir = cfg.var_dir / spec.name / "models"
        models_dir.mkdir(parents=True, exist_ok=True)
        if spec.holds_model:
            model = self.model.path
            link = models_dir / model.name
            if not link.exists():
                try:
                    link.symlink_to(model)
                except OSError:
                    shutil.copy2(model, link)
        rpc_port = _pick(spec.rpc_port)
        role = "holds the model" if spec.holds_model else "RPC worker"
        self._say(
            f"starting {spec.name} ({role}, RPC :{rpc_port}, offers {spec.memory_limit >> 20} MiB)"
        )
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        proc = self._spawn(
            spec.name,
            [
                sys.executable,
                "-m",
                "agent.main",
                "--foreground",
                "--controller-url",
                f"127.0.0.1:{self.grpc_port}",
                "--enrollment-token",
                token,
                "--node-name",
                spec.name,
                "--data-dir",
                str(cfg.var_dir / spec.name),
                "--models-dir",
                str(models_dir),
                "--advertise-address",
                "127.0.0.1",
                "--rpc-port",
                str(rpc_port),
                "--transfer-port",
                str(_pick(0)),
                "--memory-limit",
                str(spec.memory_limit),
                "--heartbeat-interval",
                "1",
                *spec.extra_args,
            ],
            env,
        )
        self.agent_procs[spec.name] = proc
        return proc

    def stop(self) -> None:
        with _signals_deferred():
            self._stop()

    def _stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGINT if os.name != "nt" else signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in reversed(self.procs):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                proc.popen.wait(remaining)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.local_cluster", description=__doc__)
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", DEFAULT_HTTP_PORT)))
    parser.add_argument(
        "--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", DEFAULT_GRPC_PORT))
    )
    parser.add_argument("--var-dir", type=Path, default=Path("var/local-cluster"))
    parser.add_argument(
        "--rpc-port",
        type=int,
        default=None,
        help=(
            "0: pick free RPC ports for the agents (default: "
            f"{' and '.join(str(a.rpc_port) for a in DEFAULT_AGENTS)} when free)"
        ),
    )
    parser.add_argument(
        "--memory-limit",
        type=int,
        default=DEFAULT_MEMORY_LIMIT,
        help="bytes each agent offers (default small enough to force a two-node split)",
    )
    args = parser.parse_args(argv)
    install_shutdown_signals()
    try:
        artifacts.ensure_llama()
        artifacts.ensure_model()
    except (KeyboardInterrupt, ShutdownRequested):
        print("local cluster: stopped before it started", file=sys.stderr)
        return 0
    except paths.FetchError as e:
        print(f"local cluster: {e}", file=sys.stderr)
        return 1
    config = ClusterConfig(
        var_dir=args.var_dir,
        port=args.port,
        grpc_port=args.grpc_port,
        agents=tuple(
            dataclasses.replace(
                a,
                memory_limit=args.memory_limit,
                rpc_port=a.rpc_port if args.rpc_port is None else args.rpc_port,
            )
            for a in DEFAULT_AGENTS
        ),
    )
    try:
        with LocalCluster(config) as cluster:
            print(f"\nOpenAI-compatible API: {cluster.url}/v1")
            print(f"  AI_API_KEY={cluster.ai_api_key}")
            print(f"  ADMIN_API_KEY={cluster.admin_api_key}")
            print(f"  model: {MODEL_NAME}    logs: {config.var_dir / 'logs'}")
            print("Ctrl-C (or SIGTERM/SIGHUP) stops the cluster.", flush=True)
            while True:
                cluster._check_alive()
                time.sleep(1)
    except (KeyboardInterrupt, ShutdownRequested) as stop:
        reason = "Ctrl-C" if isinstance(stop, KeyboardInterrupt) else str(stop)
        print(f"local cluster: stopped ({reason}); every process of the cluster has exited")
        return 0
    except ClusterError as e:
        print(f"local cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
