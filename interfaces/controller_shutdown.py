"""The controller's graceful stop: SIGTERM or SIGINT, bounded by ``SHUTDOWN_TIMEOUT``.

The first signal is logged with what the controller waits for (its running jobs, the HTTP
connections still open). The HTTP server stops taking connections and requests at once; the
running jobs go on (their agents' streams stay open) until they end, at most
``SHUTDOWN_TIMEOUT`` seconds. Then those still executing end as JOB_FAILED
(``controller_stopping``), their clients told, and the caller stops the rest of the controller
(:func:`interfaces.controller_main.stop_controller`): the process exits 0. A second signal ends
the wait at once.

uvicorn would take the signals itself, wait for open responses without a bound and then
re-raise the signal (exit 143 for SIGTERM): the controller's HTTP server is a
:class:`SignalFreeServer`, and :class:`StopSignals` handles them on the event loop instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Generator
from typing import TYPE_CHECKING

import uvicorn

from application.job_manager import CONTROLLER_STOPPING

if TYPE_CHECKING:
    from interfaces.controller_main import RunningController

log = logging.getLogger(__name__)

#: After SHUTDOWN_TIMEOUT (or a second signal), how long the endings of the jobs left and the
#: responses that tell their clients may take before the HTTP server cancels what remains (s).
END_GRACE = 5.0
#: The signals that stop the controller.
STOP_SIGNALS = ("SIGTERM", "SIGINT")


class SignalFreeServer(uvicorn.Server):
    """uvicorn's server without its own signal handling (:class:`StopSignals` does it)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class StopSignals:
    """SIGTERM/SIGINT on the running loop: the first sets :attr:`requested`, a second
    :attr:`forced` (where the loop has no signal handlers, as on Windows, Ctrl+C arrives as
    KeyboardInterrupt instead)."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.forced = asyncio.Event()
        #: The first signal's name ("" until one came).
        self.name = ""
        self._installed: list[signal.Signals] = []

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                loop.add_signal_handler(sig, self.received, name)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            self._installed.append(sig)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        self._installed = []

    def received(self, name: str) -> None:
        if not self.requested.is_set():
            self.name = name
            self.requested.set()
            return
        log.warning("%s again: no more waiting for running jobs", name)
        self.forced.set()


async def wait_for_stop(running: RunningController, signals: StopSignals) -> None:
    """Returns when a stop signal came, or when the HTTP server ended on its own."""
    http_task = running.tasks[0]
    requested = asyncio.ensure_future(signals.requested.wait())
    try:
        await asyncio.wait({http_task, requested}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        requested.cancel()


async def drain_controller(
    running: RunningController, timeout: float, signals: StopSignals
) -> None:
    """Stops taking requests and waits for the running jobs, at most ``timeout`` seconds (or
    until a second signal); ends those left. Logs what it waits for, and how it ended."""
    jobs = running.jobs
    http = running.http_server
    http_task = running.tasks[0]
    running.feed.close()  # the dashboards' live feeds: no job of theirs to wait for
    started = time.monotonic()
    log.warning(
        "%s: stopping: no new requests; waiting for %d running job(s) on %d open HTTP "
        "connection(s), at most %g s (SHUTDOWN_TIMEOUT); a second signal stops at once",
        signals.name or "stop",
        len(jobs.runs),
        len(http.server_state.connections),
        timeout,
    )
    # uvicorn's own bound: it cancels what is left of the responses after it.
    http.config.timeout_graceful_shutdown = int(timeout + END_GRACE) + 1
    http.should_exit = True
    forced = asyncio.ensure_future(signals.forced.wait())
    try:
        await asyncio.wait(
            {http_task, forced}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        forced.cancel()
    waited = time.monotonic() - started
    if http_task.done():
        log.warning("stopping: every request ended after %.1f s", waited)
        return
    http.force_exit = signals.forced.is_set()
    why = (
        "the controller stopped at once (a second signal)"
        if signals.forced.is_set()
        else f"the controller stopped: the job did not end within SHUTDOWN_TIMEOUT ({timeout:g} s)"
    )
    ending = asyncio.ensure_future(jobs.end_executing(why, CONTROLLER_STOPPING))
    done, _ = await asyncio.wait({ending}, timeout=END_GRACE)
    ended = len(ending.result()) if ending in done else len(jobs.runs)
    log.warning("stopping: %.1f s passed; ended %d running job(s) (%s)", waited, ended, why)
    await asyncio.wait({http_task}, timeout=END_GRACE)
