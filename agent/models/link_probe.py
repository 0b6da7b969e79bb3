"""Measures this node's links to its peers, for the controller's split planner: a
``ProbeLinks`` names the peers (their model file servers and a probe ticket each), and is
answered by one ``LinkReport`` (:mod:`common.link_probe`).

For each peer, one after another:

* the round trip (``rtt_ms``): the least of ``RTT_SAMPLES`` TCP connects to the peer's file
  server (connect, then close);
* the bandwidth (``mbps``): ``GET /probe/<bytes>`` from that server, over TLS with the node's
  client certificate and the peer's node certificate verified as a model fetch does
  (:func:`agent.models.fetch_sources.connect_node`), timed from the request to the last byte.

A peer that cannot be measured gets a ``LinkMeasure`` whose ``error`` says why (one line) and
zeros; nothing here raises. Blocking: it runs in a thread of its own.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import http.client
import logging
import math
import socket
import ssl
import time
from collections.abc import Sequence

from agent.models.fetch_limits import FetchLimits, Watchdog
from agent.models.fetch_sources import connect_node, describe, refusal_text
from common.link_probe import DEFAULT_PROBE_BYTES, MAX_PROBE_BYTES, PROBE_PATH, RTT_SAMPLES
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

#: Seconds one TCP connect (of the round trip) may take.
CONNECT_TIMEOUT = 2.0
#: Seconds one read of the probe's bytes may wait.
READ_TIMEOUT = 10.0
#: Seconds one download may take in all, its connect and handshake included.
PROBE_DEADLINE = 30.0
#: Bytes read at a time.
CHUNK = 1 << 20
#: The error of every peer when this node has no certificate to show them.
NO_CERTIFICATE = "no node certificate"


class ProbeError(RuntimeError):
    """A peer that could not be measured; the message says why."""


def probe_size(requested: int) -> int:
    """The bytes a probe downloads: ``DEFAULT_PROBE_BYTES`` for 0, at most
    ``MAX_PROBE_BYTES``."""
    if requested <= 0:
        return DEFAULT_PROBE_BYTES
    return min(requested, MAX_PROBE_BYTES)


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def round_trip_ms(
    host: str, port: int, samples: int = RTT_SAMPLES, timeout: float = CONNECT_TIMEOUT
) -> float:
    """The least of ``samples`` TCP connect times to ``host:port``, in milliseconds."""
    best = math.inf
    for _ in range(max(samples, 1)):
        started = time.perf_counter()
        try:
            with socket.create_connection((host, port), timeout=timeout):
                best = min(best, time.perf_counter() - started)
        except OSError as e:
            raise ProbeError(f"connect to {_where(host, port)} failed: {describe(e)}") from e
    return best * 1000.0


def download_mbps(
    peer: pb.LinkPeer, size: int, context: ssl.SSLContext, timeout: float = READ_TIMEOUT
) -> float:
    """Megabits a second downloading ``size`` bytes from the peer's ``/probe/<size>``."""
    where = f"node {peer.node_id} at {_where(peer.host, peer.port)}"
    watch = Watchdog(FetchLimits(deadline=PROBE_DEADLINE, min_rate=0, rate_window=PROBE_DEADLINE))
    received = 0
    try:
        try:
            connection = connect_node(peer.host, peer.port, peer.node_id, context, timeout, watch)
        except (OSError, ValueError) as e:
            raise ProbeError(f"cannot reach {where}: {describe(e)}") from e
        try:
            started = time.perf_counter()
            headers = {"Authorization": f"Bearer {peer.ticket}"}
            connection.request("GET", f"{PROBE_PATH}{size}", headers=headers)
            response = connection.getresponse()
            if response.status != 200:
                why = refusal_text(response, from_url=False)
                raise ProbeError(f"{where} refused the probe ({why})")
            buffer = bytearray(CHUNK)
            while received < size and (n := response.readinto(buffer)):
                received += n
            seconds = time.perf_counter() - started
        except (OSError, http.client.HTTPException) as e:
            if watch.why is not None:
                raise ProbeError(f"{where} did not finish within {PROBE_DEADLINE:g} s") from e
            raise ProbeError(f"probe from {where} cut after {received} bytes: {describe(e)}") from e
        finally:
            watch.stop()  # before the close: the descriptor is not cut once reused
            connection.close()
    finally:
        watch.stop()
    if received != size:
        raise ProbeError(f"{where} sent {received} of the {size} bytes asked for")
    return received * 8 / max(seconds, 1e-9) / 1e6


def measure_link(
    peer: pb.LinkPeer, probe_bytes: int, context: ssl.SSLContext | None
) -> pb.LinkMeasure:
    """The round trip and bandwidth to one peer (``probe_bytes`` as :func:`probe_size` reads
    it); ``error`` set and zeros when it cannot be measured. ``context`` None: this node has
    no certificate yet."""
    try:
        if context is None:
            raise ProbeError(NO_CERTIFICATE)
        rtt_ms = round_trip_ms(peer.host, peer.port)
        mbps = download_mbps(peer, probe_size(probe_bytes), context)
    except ProbeError as e:
        log.info("link to node %s not measured: %s", peer.node_id, e)
        return pb.LinkMeasure(node_id=peer.node_id, error=_one_line(str(e)))
    except Exception as e:  # reported, never raised: the controller waits for the report
        log.exception("measuring the link to node %s failed", peer.node_id)
        error = _one_line(f"{type(e).__name__}: {e}")
        return pb.LinkMeasure(node_id=peer.node_id, error=error)
    log.info("link to node %s: %.2f ms, %.0f Mbit/s", peer.node_id, rtt_ms, mbps)
    return pb.LinkMeasure(node_id=peer.node_id, rtt_ms=rtt_ms, mbps=mbps)


def measure_links(
    probe_id: str, peers: Sequence[pb.LinkPeer], probe_bytes: int, context: ssl.SSLContext | None
) -> pb.LinkReport:
    """One measure per peer, in their order, taken one after another (a probe at a time
    keeps each one's bandwidth its own)."""
    links = [measure_link(peer, probe_bytes, context) for peer in peers]
    return pb.LinkReport(probe_id=probe_id, links=links)
