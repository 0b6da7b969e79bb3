"""How often a refused agent message is recorded: an agent with a bug may send thousands, and
each must not cost a store write. The first refusal of a node is recorded at once; later
ones at most once every ``interval`` seconds per node, the event counting those in between
(``suppressed``). Every refusal is still answered on the stream and counted in /metrics."""

from __future__ import annotations

#: At most one NODE_MESSAGE_REJECTED per node this often (s).
AUDIT_INTERVAL = 10.0


class RejectionAudit:
    def __init__(self, interval: float = AUDIT_INTERVAL) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def note(self, node_id: str, now: float) -> int | None:
        """A refusal of ``node_id``'s message at ``now``: the number of refusals to report as
        suppressed when this one is to be recorded, else None (counted for the next one)."""
        last = self._last.get(node_id)
        if last is not None and now - last < self.interval:
            self._suppressed[node_id] = self._suppressed.get(node_id, 0) + 1
            return None
        self._last[node_id] = now
        return self._suppressed.pop(node_id, 0)
