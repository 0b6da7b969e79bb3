"""A TCP proxy that delays what it forwards by a fixed time in each direction: the added latency
of :mod:`bench.emulated_lan`'s links (the kernel here has no ``netem``).

Each direction of a connection is a delay line: a reader thread stamps every chunk it receives
with its due time (arrival + delay) and a writer thread sends it no earlier. A stream is shifted
by the delay, not slowed down: what arrives while earlier chunks wait is read at once. Sleeps
overshoot by tens of microseconds, so the last stretch before a due time is spun (yielding the
GIL); both sockets are ``TCP_NODELAY``, as llama.cpp's RPC sockets are.

    python -m bench.delay_proxy --listen 10.99.0.2:50052 --to 127.0.0.1:50053 --delay-ms 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence

_CHUNK_BYTES = 256 * 1024
_PR_SET_TIMERSLACK = 29
#: Sleep until this close to a due time, then spin: a sleep wakes late by up to ~60 µs.
_SPIN_S = 0.0002

#: One chunk with the time it may be sent (``time.monotonic``); None: the sender closed.
_Item = tuple[float, bytes] | None


def wait_until(due: float) -> None:
    """Return at ``due`` (``time.monotonic``), late by microseconds rather than a sleep's slack."""
    while (left := due - time.monotonic()) > 0:
        time.sleep(left - _SPIN_S if left > _SPIN_S else 0)


def _read(source: socket.socket, line: queue.SimpleQueue[_Item], delay_s: float) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(_CHUNK_BYTES):
            line.put((time.monotonic() + delay_s, data))
    line.put(None)


def _write(line: queue.SimpleQueue[_Item], sink: socket.socket, source: socket.socket) -> None:
    try:
        while (item := line.get()) is not None:
            due, data = item
            wait_until(due)
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)  # the sender's close, passed on once it is due
    except OSError:
        with contextlib.suppress(OSError):
            source.shutdown(socket.SHUT_RDWR)  # the receiver is gone: stop reading for it


def relay(client: socket.socket, server: socket.socket, delay_s: float) -> list[threading.Thread]:
    """Forward both ways between two connected sockets, each direction ``delay_s`` late; the
    sockets are closed when both directions have ended. Returns the (daemon) threads."""
    threads = []
    for source, sink in ((client, server), (server, client)):
        line: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        threads.append(threading.Thread(target=_read, args=(source, line, delay_s), daemon=True))
        threads.append(threading.Thread(target=_write, args=(line, sink, source), daemon=True))
    for thread in threads:
        thread.start()

    def close_when_done() -> None:
        for thread in threads:
            thread.join()
        client.close()
        server.close()

    threading.Thread(target=close_when_done, daemon=True).start()
    return threads


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def serve(listener: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    """Accept on ``listener`` until it is closed, relaying each connection to ``target``."""
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return  # closed (or broken: the proxy's process ends, and its worker is unreachable)
        try:
            upstream = socket.create_connection(target, timeout=10)
        except OSError as exc:
            print(f"delay_proxy: cannot reach {target[0]}:{target[1]}: {exc}", flush=True)
            client.close()
            continue
        upstream.settimeout(None)
        relay(_nodelay(client), _nodelay(upstream), delay_s)


def listen(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(16)
    return listener


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def tighten_timer_slack() -> bool:
    """Linux: let this process's sleeps wake within a microsecond of their time instead of the
    default 50 µs slack (``PR_SET_TIMERSLACK``; the threads started afterwards inherit it)."""
    if sys.platform != "linux":
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return int(prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)) == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.delay_proxy", description=__doc__)
    parser.add_argument("--listen", type=_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--to", type=_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True, help="added each way")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms must not be negative")
    tighten_timer_slack()
    listener = listen(*args.listen)
    print(
        f"delay_proxy: {args.listen[0]}:{args.listen[1]} -> {args.to[0]}:{args.to[1]}, "
        f"+{args.delay_ms:g} ms each way",
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        serve(listener, args.to, args.delay_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
