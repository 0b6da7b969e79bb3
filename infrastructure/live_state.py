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
    def __init__(self, url: str, prefix: str = KEY_PREFIX) -> None:
        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._prefix = prefix

    def _key(self, node_id: str) -> str:
        return f"{self._prefix}{node_id}"

    def record_heartbeat(self, node_id: str, telemetry: dict[str, Any], at: float) -> None:
        key = self._key(node_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(
            key,
            mapping={"last_seen": repr(at), "telemetry": orjson.dumps(telemetry), "connected": 1},
        )
        pipe.expire(key, TTL_SECONDS)
        pipe.execute()

    def mark_connected(self, node_id: str, connected: bool, at: float) -> None:
        key = self._key(node_id)
        mapping: dict[str, str | int] = {"connected": int(connected)}
        if connected or not self._redis.hexists(key, "last_seen"):
            mapping["last_seen"] = repr(at)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(key, mapping=cast(Any, mapping))
        pipe.expire(key, TTL_SECONDS)
        pipe.execute()

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
        keys = list(self._redis.scan_iter(match=f"{self._prefix}*", count=500))
        if not keys:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        out: dict[str, LiveNode] = {}
        for key, raw in zip(keys, pipe.execute(), strict=True):
            node_id = key.decode()[len(self._prefix) :]
            live = self._decode(node_id, raw)
            if live is not None:
                out[node_id] = live
        return out

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False


def live_state_for(redis_url: str | None, prefix: str = KEY_PREFIX) -> LiveState:
    return RedisLiveState(redis_url, prefix) if redis_url else InProcessLiveState()
