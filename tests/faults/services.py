"""Private PostgreSQL and Redis servers for fault tests, which stop, pause and restart them.

The machine's shared services are never touched: each test gets its own ``redis-server`` and
its own PostgreSQL cluster (``initdb`` + ``pg_ctl``) on free loopback ports, in the test's
temporary directory. PostgreSQL refuses to run as root, so as root it runs as the
``postgres`` system user (``runuser``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, ready: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready in {timeout:g}s")
        time.sleep(0.05)


class OwnRedis:
    """``redis-server`` on a free port, keeping nothing on disk."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OwnRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait("redis-server", self.answers)
        return self

    def answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None

    def pause(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        raise RuntimeError(f"{name} not found (PostgreSQL server binaries)")
    return found


class OwnPostgres:
    """A PostgreSQL cluster of its own: trust auth, loopback only, no fsync (a test cluster)."""

    def __init__(self) -> None:
        # Not under pytest's tmp_path: as root that is private to root (0700), and the
        # postgres user must reach its data directory.
        self.workdir = Path(tempfile.mkdtemp(prefix="dacp-fault-pg-"))
        self.datadir = self.workdir / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as_postgres:
            shutil.chown(self.workdir, user="postgres", group="postgres")

    def _run(self, *argv: str) -> None:
        subprocess.run(
            [*self._as_postgres, *argv], check=True, stdout=subprocess.DEVNULL, timeout=120
        )

    def init(self) -> OwnPostgres:
        self._run(
            _pg_bin("initdb"),
            "-D",
            str(self.datadir),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
        )
        return self

    def start(self) -> OwnPostgres:
        options = f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            _pg_bin("pg_ctl"),
            "-D",
            str(self.datadir),
            "-o",
            options,
            "-l",
            str(self.workdir / "postgres.log"),
            "-w",
            "start",
        )
        _wait("postgres", self.answers)
        return self

    def answers(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=1) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def stop(self, mode: str = "fast") -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop")

    def _postmaster_pid(self) -> int:
        return int((self.datadir / "postmaster.pid").read_text().splitlines()[0])

    def pause(self) -> None:
        """Freezes the postmaster and every backend (SIGSTOP): a store that hangs."""
        for pid in self._pids():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self._pids():
            os.kill(pid, signal.SIGCONT)

    def _pids(self) -> list[int]:
        import psutil

        master = psutil.Process(self._postmaster_pid())
        return [master.pid, *(child.pid for child in master.children(recursive=True))]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.resume()
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.workdir, ignore_errors=True)
