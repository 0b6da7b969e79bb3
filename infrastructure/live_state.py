"""Live node state (heartbeats): a dict in this process, mirrored to Redis when configured.

A heartbeat costs the controller one dict assignment on the event loop: no network call, no
thread hop. With Redis, :class:`WriteBehindLiveState` writes what changed in one pipeline per
``flush_interval`` from a thread of its own, and reads back what other controllers wrote (their
nodes), so every controller sees every node a flush later. Redis restarting empty is refilled
by the next heartbeats; Redis down leaves this controller's own view intact.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any, cast

import orjson
import redis

from application.ports import LiveNode, LiveState

log = logging.getLogger(__name__)

KEY_PREFIX = "dacp:live:"
#: Live entries outlive any sane OFFLINE_AFTER, then expire so Redis does not grow.
TTL_SECONDS = 24 * 3600
#: How often a node's key gets its TTL renewed by the write-behind flush.
TTL_REFRESH = 600.0


class InProcessLiveState:
    def __init__(self) -> None:
        self._nodes: dict[str, LiveNode] = {}
        self._lock = threading.Lock()
        self._leases: dict[str, float] = {}  # controller -> monotonic expiry

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None:
        with self._lock:
            self._nodes[node_id] = LiveNode(node_id, at, telemetry, True)

    def mark_connected(self, node_id: str, connected: bool, at: float) -> None:
        with self._lock:
            old = self._nodes.get(node_id)
            telemetry = old.telemetry if old else {}
            last_seen = at if connected or old is None else old.last_seen
            self._nodes[node_id] = LiveNode(node_id, last_seen, telemetry, connected)

    def get(self, node_id: str) -> LiveNode | None:
        with self._lock:
            return self._nodes.get(node_id)

    def all(self) -> dict[str, LiveNode]:
        with self._lock:
            return dict(self._nodes)

    def ping(self) -> bool:
        return True

    def local_only(self) -> bool:
        return False  # no shared store is configured: nothing to fall back from

    def renew_lease(self, owner: str, ttl: float) -> None:
        with self._lock:
            self._leases[owner] = time.monotonic() + ttl

    def live_owners(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            return {owner for owner, until in self._leases.items() if until > now}

    def close(self) -> None:
        pass


class RedisLiveState:
    """One hash per node (``<prefix>node:<id>``) plus a set indexing them (``<prefix>index``),
    so reading every node is one SMEMBERS and one pipelined HGETALL, never a keyspace scan."""

    def __init__(self, url: str, prefix: str = KEY_PREFIX) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._prefix = prefix
        self._index = f"{prefix}index"

    def _key(self, node_id: str) -> str:
        return f"{self._prefix}node:{node_id}"

    def _write(self, node_id: str, mapping: dict[str, Any]) -> None:
        self.write_many({node_id: mapping})

    def write_many(
        self, mappings: dict[str, dict[str, Any]], *, expire: Iterable[str] | None = None
    ) -> None:
        """Writes several nodes' fields in one pipeline (one round trip). ``expire`` names the
        nodes whose keys get their TTL renewed (default: all of them)."""
        if not mappings:
            return
        pipe = self._redis.pipeline(transaction=False)
        for node_id, mapping in mappings.items():
            pipe.hset(self._key(node_id), mapping=cast(Any, mapping))
        for node_id in mappings if expire is None else expire:
            pipe.expire(self._key(node_id), TTL_SECONDS)
        pipe.sadd(self._index, *mappings)
        pipe.expire(self._index, TTL_SECONDS)
        pipe.execute()

    def put(self, live: LiveNode) -> None:
        self.write_many({live.node_id: _fields(live)})

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None:
        self._write(
            node_id,
            {"last_seen": repr(at), "telemetry": orjson.dumps(telemetry), "connected": 1},
        )

    def mark_connected(self, node_id: str, connected: bool, at: float) -> None:
        mapping: dict[str, Any] = {"connected": int(connected)}
        if connected or not self._redis.hexists(self._key(node_id), "last_seen"):
            mapping["last_seen"] = repr(at)
        self._write(node_id, mapping)

    def _decode(self, node_id: str, raw: dict[bytes, bytes]) -> LiveNode | None:
        if not raw or b"last_seen" not in raw:
            return None
        telemetry = orjson.loads(raw[b"telemetry"]) if raw.get(b"telemetry") else {}
        return LiveNode(
            node_id=node_id,
            last_seen=float(raw[b"last_seen"]),
            telemetry=telemetry,
            connected=raw.get(b"connected", b"0") == b"1",
        )

    def get(self, node_id: str) -> LiveNode | None:
        return self._decode(node_id, self._redis.hgetall(self._key(node_id)))  # type: ignore[arg-type]

    def all(self, skip: Collection[str] = ()) -> dict[str, LiveNode]:
        """Every node's entry but those in ``skip``."""
        members = self._redis.smembers(self._index)
        node_ids = sorted(m.decode() for m in members if m.decode() not in skip)  # type: ignore[union-attr]
        if not node_ids:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.hgetall(self._key(node_id))
        out: dict[str, LiveNode] = {}
        gone = []
        for node_id, raw in zip(node_ids, pipe.execute(), strict=True):
            live = self._decode(node_id, raw)
            if live is None:
                gone.append(node_id)
            else:
                out[node_id] = live
        if gone:  # hashes that expired: drop them from the index
            self._redis.srem(self._index, *gone)
        return out

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def local_only(self) -> bool:
        return False  # every call goes to Redis (and raises when it cannot)

    def renew_lease(self, owner: str, ttl: float) -> None:
        key = f"{self._prefix}controller:{owner}"
        if ttl <= 0:
            self._redis.delete(key)  # given up
        else:
            self._redis.set(key, b"1", px=max(1, int(ttl * 1000)))

    def live_owners(self) -> set[str]:
        start = len(f"{self._prefix}controller:")
        keys = self._redis.scan_iter(match=f"{self._prefix}controller:*", count=1000)
        return {(k.decode() if isinstance(k, bytes) else str(k))[start:] for k in keys}


def _fields(live: LiveNode) -> dict[str, Any]:
    return {
        "last_seen": repr(live.last_seen),
        "telemetry": orjson.dumps(live.telemetry),
        "connected": int(live.connected),
    }


class WriteBehindLiveState(InProcessLiveState):
    """This controller's nodes in memory at once, mirrored to (and merged with) Redis."""

    def __init__(self, backend: RedisLiveState, flush_interval: float = 1.0) -> None:
        super().__init__()
        self.backend = backend
        self.flush_interval = flush_interval
        self._dirty: set[str] = set()
        self._remote: dict[str, LiveNode] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._renewed: dict[str, float] = {}  # node → when its key's TTL was last renewed

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None:
        with self._lock:
            self._nodes[node_id] = LiveNode(node_id, at, telemetry, True)
            self._dirty.add(node_id)

    def mark_connected(self, node_id: str, connected: bool, at: float) -> None:
        with self._lock:
            old = _newer(self._nodes.get(node_id), self._remote.get(node_id))
            telemetry = old.telemetry if old else {}
            last_seen = at if connected or old is None else old.last_seen
            self._nodes[node_id] = LiveNode(node_id, last_seen, telemetry, connected)
            self._dirty.add(node_id)

    def get(self, node_id: str) -> LiveNode | None:
        with self._lock:
            return _newer(self._nodes.get(node_id), self._remote.get(node_id))

    def all(self) -> dict[str, LiveNode]:
        with self._lock:
            merged = dict(self._remote)
            for node_id, local in self._nodes.items():
                merged[node_id] = _newer(local, merged.get(node_id)) or local
            return merged

    def ping(self) -> bool:
        return self.backend.ping()

    def local_only(self) -> bool:
        return self._failing

    def renew_lease(self, owner: str, ttl: float) -> None:
        self.backend.renew_lease(owner, ttl)

    def live_owners(self) -> set[str]:
        return self.backend.live_owners()

    def flush(self) -> None:
        """Writes the entries that changed since the last flush; reads the entries of nodes
        this controller has not heard from (other controllers' nodes)."""
        now = time.monotonic()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            entries = {n: self._nodes[n] for n in dirty if n in self._nodes}
            # Nodes connected here are this controller's to report; read the others.
            local = {n for n, live in self._nodes.items() if live.connected}
        # A key's TTL is renewed every TTL_REFRESH seconds, not with every write.
        renew = [n for n in entries if now - self._renewed.get(n, -TTL_REFRESH) >= TTL_REFRESH]
        try:
            self.backend.write_many({n: _fields(live) for n, live in entries.items()}, expire=renew)
            self._renewed.update(dict.fromkeys(renew, now))
            remote = self.backend.all(skip=local)
        except redis.RedisError as e:
            with self._lock:
                self._dirty |= dirty
            if not self._failing:
                log.warning("live state: Redis unavailable (%s); keeping heartbeats here", e)
            self._failing = True
            return
        if self._failing:
            log.info("live state: Redis is back")
            self._failing = False
        with self._lock:
            self._remote = remote

    def start(self) -> WriteBehindLiveState:
        self.flush()
        self._thread = threading.Thread(target=self._run, name="live-state-flush", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush()
            except Exception:
                log.exception("live state flush failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.flush()
        except Exception:
            log.exception("final live state flush failed")


def _newer(a: LiveNode | None, b: LiveNode | None) -> LiveNode | None:
    """The entry seen last (``a``, this controller's own, on a tie)."""
    if a is None or b is None:
        return a or b
    return b if b.last_seen > a.last_seen else a


def live_state_for(redis_url: str | None, prefix: str = KEY_PREFIX) -> LiveState:
    if not redis_url:
        return InProcessLiveState()
    return WriteBehindLiveState(RedisLiveState(redis_url, prefix)).start()
