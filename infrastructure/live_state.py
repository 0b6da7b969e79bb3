"""Live node state (heartbeats): a Redis hash per node, or a dict in this process."""

from __future__ import annotations

import threading
from typing import Any, cast

import orjson
import redis

from application.ports import LiveNode, LiveState

KEY_PREFIX = "dacp:live:"
#: Live entries outlive any sane OFFLINE_AFTER, then expire so Redis does not grow.
TTL_SECONDS = 24 * 3600


class InProcessLiveState:
    blocking = False

    def __init__(self) -> None:
        self._nodes: dict[str, LiveNode] = {}
        self._lock = threading.Lock()

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


class RedisLiveState:
    """One hash per node (``<prefix>node:<id>``) plus a set indexing them (``<prefix>index``),
    so reading every node is one SMEMBERS and one pipelined HGETALL, never a keyspace scan."""

    blocking = True

    def __init__(self, url: str, prefix: str = KEY_PREFIX) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._prefix = prefix
        self._index = f"{prefix}index"

    def _key(self, node_id: str) -> str:
        return f"{self._prefix}node:{node_id}"

    def _write(self, node_id: str, mapping: dict[str, Any]) -> None:
        key = self._key(node_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, mapping=cast(Any, mapping))
        pipe.expire(key, TTL_SECONDS)
        pipe.sadd(self._index, node_id)
        pipe.expire(self._index, TTL_SECONDS)
        pipe.execute()

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

    def all(self) -> dict[str, LiveNode]:
        node_ids = sorted(m.decode() for m in self._redis.smembers(self._index))  # type: ignore[union-attr]
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


def live_state_for(redis_url: str | None, prefix: str = KEY_PREFIX) -> LiveState:
    return RedisLiveState(redis_url, prefix) if redis_url else InProcessLiveState()
