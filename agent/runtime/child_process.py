"""Child processes that die with their parent (Linux: ``PR_SET_PDEATHSIG``).

``PR_SET_PDEATHSIG`` asks the kernel to send a signal to the child when the *thread* that forked
it exits, so a parent killed with SIGKILL (no cleanup code runs) still takes its children with
it. Two users:

* the agent's llama.cpp children (:func:`spawn_tied_to_agent`, SIGKILL: nothing to clean up in
  a ``llama-server``), forked from one long-lived thread because the agent's asyncio code runs
  blocking calls on short-lived worker threads;
* the local cluster's controller and agents (:func:`set_parent_death_signal` with SIGTERM,
  through ``ops.tied``, so they shut down in order and take their own children with them).

A ``preexec_fn`` forces a real ``fork()`` of the parent, which runs gRPC's ``pthread_atfork``
handlers in the child; in a parent that uses gRPC with fork support on (a test process, say)
that can crash the child before ``exec``. So the local cluster does not use one: ``ops.tied``
sets the signal in the child after ``exec`` and then ``exec``s the real command.

Elsewhere (macOS, Windows) these fall back to a plain ``Popen``: the callers' own cleanup
(``atexit`` hooks, context managers) is then the only guarantee.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, cast

_PR_SET_PDEATHSIG = 1


def _linux_prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return cast("Callable[..., int]", prctl)


def set_parent_death_signal(sig: signal.Signals, expected_parent: int) -> bool:
    """Asks the kernel to send ``sig`` to this process when its parent dies; kills this process
    with ``sig`` at once when the parent is already gone. False where unsupported."""
    prctl = _linux_prctl()
    if prctl is None:
        return False
    prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def pdeathsig_preexec(
    parent_pid: int, sig: signal.Signals = signal.SIGKILL
) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when its forking thread
    exits; None where the platform has no such call."""
    prctl = _linux_prctl()  # resolved before fork: the child only makes the call
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
            os.kill(os.getpid(), sig)

    return preexec


_SpawnJob = tuple[list[str], dict[str, Any], "concurrent.futures.Future[subprocess.Popen[bytes]]"]


class _Spawner:
    """Runs every ``Popen`` on one daemon thread that lives as long as the agent.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process,
    so children must not be forked from short-lived threads (``asyncio.to_thread`` workers).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_SpawnJob] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if sys.platform != "linux":
            return cast("subprocess.Popen[bytes]", subprocess.Popen(argv, **kwargs))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="dacp-runtime-spawner", daemon=True
                )
                self._thread.start()
        future: concurrent.futures.Future[subprocess.Popen[bytes]] = concurrent.futures.Future()
        self._jobs.put((argv, kwargs, future))
        return future.result()

    def _run(self) -> None:
        while True:
            argv, kwargs, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                preexec = pdeathsig_preexec(os.getpid())
                proc = subprocess.Popen(argv, preexec_fn=preexec, **kwargs)
                future.set_result(cast("subprocess.Popen[bytes]", proc))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)


_SPAWNER = _Spawner()


def spawn_tied_to_agent(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``Popen`` whose child is SIGKILLed by the kernel if the agent process dies."""
    return _SPAWNER.popen(argv, **kwargs)
