"""How a node agent stops on a signal: the first SIGINT/SIGTERM/SIGHUP drains it, a second
stops it at once.

:class:`StopSignals` holds the stop's own state (draining or not, what the ``Goodbye`` will
say, the process's exit status) and runs the drain; the session gives it what it needs as
callables: the jobs still running, telling the controller ``Stopping``, and stopping itself.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)

#: How often a draining agent looks whether its jobs have ended (s).
DRAIN_POLL_INTERVAL = 0.1
#: Why the agent stops, when nothing more is known (``stop()``, no drain).
GOODBYE_REASON = "the agent is stopping"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopSignals:
    """The first stop signal drains (``Stopping`` to the controller, the running jobs end, at
    most ``drain_timeout``; at once with a timeout of 0), a second one stops at once with exit
    status 128 + its number."""

    def __init__(
        self,
        drain_timeout: float,
        running_jobs: Callable[[], list[str]],
        send_stopping: Callable[[], None],
        request_stop: Callable[[], None],
        stop_requested: Callable[[], bool],
    ) -> None:
        self.drain_timeout = drain_timeout
        self._running_jobs = running_jobs
        self._send_stopping = send_stopping
        self._request_stop = request_stop
        self._stop_requested = stop_requested
        #: While it runs, plans are refused (the node takes no new job).
        self.draining = False
        #: The drain the first signal started (None: none).
        self.task: asyncio.Task[None] | None = None
        #: What the Goodbye says (why the agent stops).
        self.goodbye_reason = GOODBYE_REASON
        #: The process's exit status: 0, or 128 + the number of a second stop signal.
        self.exit_code = 0

    def on_signal(self, signum: int) -> None:
        """A stop signal (safe from a signal handler)."""
        name = signal_name(signum)
        if self._stop_requested():
            log.info("%s: the agent is stopping already", name)
            return
        if self.draining:
            running = self._running_jobs()
            log.warning(
                "%s again: stopping at once; %d job(s) still running are lost", name, len(running)
            )
            self.goodbye_reason = (
                f"stopped at once by a second signal ({name}) with {len(running)} job(s) running"
            )
            self.exit_code = 128 + signum
            self._request_stop()
            return
        if self.drain_timeout <= 0:
            self.goodbye_reason = f"stopped by {name} without a drain (drain timeout 0)"
            self._request_stop()
            return
        self.draining = True
        self._send_stopping()
        self.task = asyncio.get_running_loop().create_task(self._drain(name))

    async def _drain(self, name: str) -> None:
        """Lets the running jobs finish, at most ``drain_timeout``, then stops the session
        (its Goodbye says how the drain ended)."""
        timeout = self.drain_timeout
        running = self._running_jobs()
        log.warning(
            "%s: draining: the agent stops once its %d running job(s) end, at most %g s "
            "(--drain-timeout); no new job is taken; a second signal stops it at once",
            name,
            len(running),
            timeout,
        )
        try:
            async with asyncio.timeout(timeout):
                while self._running_jobs():
                    await asyncio.sleep(DRAIN_POLL_INTERVAL)
            self.goodbye_reason = f"drained ({len(running)} job(s) finished)"
            log.info("drained: no job is running; stopping")
        except TimeoutError:
            left = self._running_jobs()
            self.goodbye_reason = (
                f"its drain timed out after {timeout:g} s with {len(left)} job(s) running"
            )
            log.warning(
                "the drain timed out after %g s: stopping; %d job(s) still running are lost",
                timeout,
                len(left),
            )
        self._request_stop()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


def install_signal_handlers(on_signal: Callable[[int], None]) -> list[signal.Signals]:
    """SIGINT/SIGTERM/SIGHUP call ``on_signal``, where the loop supports it (not on Windows,
    where Ctrl+C arrives as KeyboardInterrupt and asyncio.run cancels the session instead)."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is None:
            continue
        try:
            loop.add_signal_handler(sig, on_signal, int(sig))
        except (NotImplementedError, RuntimeError, ValueError, AttributeError):
            continue
        installed.append(sig)
    return installed
