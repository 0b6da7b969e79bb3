"""How long one source may take to send a model file (:class:`FetchLimits`, the agent's
``--fetch-deadline``, ``--fetch-min-rate`` and ``--fetch-rate-window``), and the watchdog that
holds a fetch to them (:class:`Watchdog`): it shuts the connection's socket down when the
source sends too little over a window, or has not finished by the deadline, which ends any read
under way (a per-read timeout alone lets a source that sends a byte now and then hold a fetch
for ever).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Defaults of :class:`FetchLimits` (the agent's ``--fetch-deadline``, ``--fetch-min-rate``
#: and ``--fetch-rate-window``): a LAN moves a multi-GB file at tens to hundreds of MB/s; a
#: source below 1 MiB/s for a minute is broken or hostile, and six hours is enough for 80 GB
#: at 4 MB/s.
DEFAULT_FETCH_DEADLINE = 6 * 3600.0
DEFAULT_FETCH_MIN_RATE = 1 << 20
DEFAULT_FETCH_RATE_WINDOW = 60.0
#: The least a read asks for at once (see :meth:`FetchLimits.read_size`).
MIN_READ = 64 << 10


@dataclass(frozen=True)
class FetchLimits:
    """How long one source may take to send a file."""

    #: Seconds from the first connect to the last byte.
    deadline: float = DEFAULT_FETCH_DEADLINE
    #: Bytes a second a source must average over every ``rate_window``.
    min_rate: float = DEFAULT_FETCH_MIN_RATE
    #: Seconds the rate is averaged over (the first window starts with the connect).
    rate_window: float = DEFAULT_FETCH_RATE_WINDOW

    def __post_init__(self) -> None:
        if self.deadline <= 0 or self.rate_window <= 0 or self.min_rate < 0:
            raise ValueError("fetch limits: deadline and rate window must be positive")

    def read_size(self, buffer: int) -> int:
        """Bytes one read (into a ``buffer``-byte buffer) waits for: at most a quarter of what
        the minimum rate asks of a window, so a source just above the floor is seen to be (a
        read completes only once its bytes are all there)."""
        return max(MIN_READ, min(buffer, int(self.min_rate * self.rate_window / 4)))


class Watchdog:
    """Cuts a source's connection (shuts its socket down, which ends any read under way) when
    the source stays below the minimum rate over a window, or outlives the deadline. Started
    before the connect; :meth:`stop` before the socket is closed."""

    def __init__(self, limits: FetchLimits) -> None:
        self.limits = limits
        #: Bytes of the file received so far (written by the receiving thread only).
        self.received = 0
        #: Why the connection was cut (None: it was not).
        self.why: str | None = None
        self._fd = -1
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="model-fetch-watch", daemon=True)
        self._thread.start()

    def watch(self, sock: socket.socket) -> None:
        """The connection to cut (its descriptor: the same once TLS wraps it)."""
        with self._lock:
            self._fd = sock.fileno()

    def forget(self) -> None:
        """Before the watched socket is closed (its descriptor may then be reused)."""
        with self._lock:
            self._fd = -1

    def _watch(self) -> None:
        limits = self.limits
        step = min(limits.rate_window / 4, limits.deadline)
        samples: list[tuple[float, int]] = [(self._started, 0)]
        while not self._done.wait(step):
            now, received = time.monotonic(), self.received
            samples.append((now, received))
            if now - self._started >= limits.deadline:
                self._cut(f"it had not finished within {limits.deadline:g} s (--fetch-deadline)")
                return
            # The latest sample a whole window old: the rate over (at least) the last window.
            old = [sample for sample in samples if sample[0] <= now - limits.rate_window]
            if not old:
                continue
            since, base = old[-1]
            del samples[: len(old) - 1]
            rate = (received - base) / (now - since)
            if rate < limits.min_rate:
                self._cut(
                    f"it sent {received - base} bytes in {now - since:.1f} s, below the "
                    f"minimum {limits.min_rate:g} bytes/s (--fetch-min-rate)"
                )
                return

    def _cut(self, why: str) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self.why = why
            if self._fd < 0:
                return
            try:
                sock = socket.socket(fileno=self._fd)
            except OSError:
                return
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.detach()

    def stop(self) -> None:
        """Before the connection is closed: no cut after this returns."""
        with self._lock:
            self._done.set()
            self._fd = -1
        self._thread.join()


def add_fetch_arguments(
    parser: argparse.ArgumentParser,
    seconds: Callable[[str], float],
    size: Callable[[str], int],
) -> None:
    """The ``--fetch-*`` flags (``seconds`` and ``size``: the parser's argument types)."""
    parser.add_argument(
        "--fetch-deadline",
        type=seconds,
        default=DEFAULT_FETCH_DEADLINE,
        metavar="SECONDS",
        help="longest one source may take to send a model file; then the next source is tried "
        "(default: %(default)g)",
    )
    parser.add_argument(
        "--fetch-min-rate",
        type=size,
        default=DEFAULT_FETCH_MIN_RATE,
        metavar="BYTES",
        help="least a source must send a second, averaged over --fetch-rate-window, in bytes "
        "or with a K/M/G suffix; a slower one is given up for the next (default: 1M)",
    )
    parser.add_argument(
        "--fetch-rate-window",
        type=seconds,
        default=DEFAULT_FETCH_RATE_WINDOW,
        metavar="SECONDS",
        help="the window --fetch-min-rate is averaged over (default: %(default)g)",
    )


def fetch_limits_from_args(args: argparse.Namespace) -> FetchLimits:
    return FetchLimits(args.fetch_deadline, args.fetch_min_rate, args.fetch_rate_window)
