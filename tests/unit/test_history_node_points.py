"""What the dashboard's history samples of each node: only nodes that may take work, their
slots in use, and each device's memory as the latest heartbeat tells it."""

from __future__ import annotations

from typing import Any

from application.metrics_history import DevicePoint, NodePoint
from application.ports import LiveNode
from interfaces.http.admin.operations_api import node_points

GIB = 1 << 30


def device(name: str, kind: str, total_gib: int, free_gib: int) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "memory_total_bytes": total_gib * GIB,
        "memory_free_bytes": free_gib * GIB,
    }


def row(node_id: str, state: str = "READY", **fields: Any) -> dict[str, Any]:
    resources = {"devices": [device("CUDA0", "gpu", 8, 8), device("CPU", "cpu", 16, 12)]}
    base = {"node_id": node_id, "name": f"name-{node_id}", "state": state, "slots": 4}
    return {"current_jobs": [], "revoked": False, "resources": resources, **base, **fields}


def test_nodes_that_may_take_work_with_their_slots_and_devices() -> None:
    rows = [
        row("a", current_jobs=["j1", "j2"]),
        row("b", state="OFFLINE"),
        row("c", revoked=True),
        row("d", state="DRAINING"),
    ]
    beat = LiveNode(
        "a",
        last_seen=1.0,
        telemetry={
            "cpu_percent": 42.5,
            "devices": [{"name": "CUDA0", "memory_free_bytes": 3 * GIB}],
        },
    )
    a, d = node_points(rows, {"a": beat})
    assert a == NodePoint(
        node_id="a",
        name="name-a",
        busy_slots=2,
        slots=4,
        cpu_percent=42.5,
        devices=(
            DevicePoint("CUDA0", 8 * GIB, 3 * GIB),  # the heartbeat's figure
            DevicePoint("CPU", 16 * GIB, 12 * GIB),  # the last report's: no heartbeat named it
        ),
    )
    # No heartbeat yet: no CPU figure, the reported memory.
    assert (d.node_id, d.busy_slots, d.cpu_percent) == ("d", 0, None)
    assert d.devices[0] == DevicePoint("CUDA0", 8 * GIB, 8 * GIB)
