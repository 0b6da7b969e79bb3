"""A node's devices from the agent's inventory to what the controller keeps, plans from and
shows: the protobuf round trip, the bounds on what a node may report, the heartbeat's free
memory per device, and the admin API's node view."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from agent.node.discovery import Inventory, Telemetry
from agent.node.node_devices import DeviceInfo, DeviceSample
from application.ports import LiveNode
from application.scheduler import node_devices
from common.contract import DEVICE_CPU, DEVICE_GPU, HOST_DEVICE
from domain.bounded_text import ID_MAX, bounded
from interfaces.grpc.grpc_convert import (
    MAX_DEVICES,
    clamp_strings,
    heartbeat_to_dict,
    resources_from_report,
)
from interfaces.http.admin.admin_api import node_view
from wire import control_pb2 as pb

GIB = 1 << 30
H100 = DeviceInfo("CUDA0", "NVIDIA H100 80GB HBM3", DEVICE_GPU, 79 * GIB, 78 * GIB, "GPU-aa", 0)
HOST = DeviceInfo(HOST_DEVICE, "Intel(R) Xeon(R)", DEVICE_CPU, 64 * GIB, 60 * GIB)


def agent_inventory(*devices: DeviceInfo) -> Inventory:
    return Inventory(
        hostname="gpu-box",
        os="Linux",
        arch="x86_64",
        cpu_model="Intel(R) Xeon(R)",
        cpu_cores=16,
        cpu_threads=32,
        ram_total_bytes=64 * GIB,
        disk_total_bytes=GIB,
        disk_free_bytes=GIB,
        gpus=(),
        advertised_address="10.0.0.5",
        rpc_port=50052,
        devices=devices,
        llama_version="4567 (abc1234)",
        rpc_protocol="7.0.0",
        llama_backend="cuda",
    )


def on_the_wire(inventory: Inventory) -> pb.Inventory:
    """The inventory as the controller receives it: serialized, parsed, strings clamped."""
    received = pb.Inventory.FromString(inventory.to_proto().SerializeToString())
    clamp_strings(received)
    return received


def test_devices_and_the_build_travel_to_the_nodes_resources() -> None:
    resources = resources_from_report(on_the_wire(agent_inventory(H100, HOST)), 50 * GIB)
    assert resources["devices"] == [
        {
            "name": "CUDA0",
            "description": "NVIDIA H100 80GB HBM3",
            "kind": "gpu",
            "memory_total_bytes": 79 * GIB,
            "memory_free_bytes": 78 * GIB,
            "uuid": "GPU-aa",
        },
        {
            "name": "CPU",
            "description": "Intel(R) Xeon(R)",
            "kind": "cpu",
            "memory_total_bytes": 64 * GIB,
            "memory_free_bytes": 60 * GIB,
            "uuid": "",
        },
    ]
    assert (resources["llama_version"], resources["rpc_protocol"], resources["llama_backend"]) == (
        "4567 (abc1234)",
        "7.0.0",
        "cuda",
    )


def test_an_agent_before_devices_reports_none() -> None:
    resources = resources_from_report(pb.Inventory(ram_total_bytes=GIB), None)
    assert resources["devices"] == []
    assert (resources["llama_version"], resources["rpc_protocol"]) == ("", "")


def test_what_a_node_may_report_is_bounded() -> None:
    many = [DeviceInfo(f"CUDA{i}", "x" * 10_000, DEVICE_GPU, GIB, GIB) for i in range(200)]
    odd = DeviceInfo("NPU0", "an accelerator", "npu", GIB, GIB)
    nameless = DeviceInfo("", "no name", DEVICE_GPU, GIB, GIB)
    resources = resources_from_report(on_the_wire(agent_inventory(odd, nameless, *many)), None)
    devices = resources["devices"]
    assert len(devices) < MAX_DEVICES  # two of the first 64 were left out
    assert [d["name"] for d in devices[:2]] == ["CUDA0", "CUDA1"]
    assert {d["description"] for d in devices} == {bounded("x" * 10_000, ID_MAX)}
    beats = Telemetry(1.0, GIB, devices=tuple(DeviceSample("N" * 500, 1) for _ in range(100)))
    telemetry = heartbeat_to_dict(beats.to_proto())
    assert len(telemetry["devices"]) == MAX_DEVICES
    assert telemetry["devices"][0]["name"] == bounded("N" * 500, ID_MAX)


def test_the_heartbeats_free_memory_is_what_the_planner_and_the_api_see() -> None:
    resources = resources_from_report(on_the_wire(agent_inventory(H100, HOST)), 50 * GIB)
    beat = Telemetry(
        5.0, 40 * GIB, devices=(DeviceSample("CUDA0", 30 * GIB), DeviceSample("CPU", 40 * GIB))
    )
    telemetry = heartbeat_to_dict(beat.to_proto())
    assert telemetry["devices"] == [
        {"name": "CUDA0", "memory_free_bytes": 30 * GIB},
        {"name": "CPU", "memory_free_bytes": 40 * GIB},
    ]
    row: dict[str, Any] = {
        "node_id": "n1",
        "name": "gpu-box",
        "state": "READY",
        "resources": resources,
        "inventory": {"memory_limit_bytes": 0},
    }
    live = LiveNode("n1", 100.0, telemetry)
    (planned,) = node_devices(row, live)  # the host CPU is planned as host memory
    assert (planned.name, planned.usable_bytes) == ("CUDA0", 30 * GIB)

    services: Any = SimpleNamespace(
        live=SimpleNamespace(get=lambda _id: live),
        connections=SimpleNamespace(is_connected=lambda _id: True),
    )
    view = node_view(services, row, 101.0)
    assert [(d["name"], d["kind"], d["memory_free_bytes"]) for d in view["devices"]] == [
        ("CUDA0", "gpu", 30 * GIB),
        ("CPU", "cpu", 40 * GIB),
    ]
    assert view["devices"][0]["description"] == "NVIDIA H100 80GB HBM3"
    assert view["devices"][0]["memory_total_bytes"] == 79 * GIB
    assert view["llama"] == {
        "version": "4567 (abc1234)",
        "backend": "cuda",
        "rpc_protocol": "7.0.0",
    }

    # No heartbeat yet: the report's figures; a row from before devices: none.
    quiet: Any = SimpleNamespace(
        live=SimpleNamespace(get=lambda _id: None),
        connections=SimpleNamespace(is_connected=lambda _id: False),
    )
    assert [d["memory_free_bytes"] for d in node_view(quiet, row, 0.0)["devices"]] == [
        78 * GIB,
        60 * GIB,
    ]
    old = node_view(quiet, {**row, "resources": {"ram_total_bytes": GIB}}, 0.0)
    assert old["devices"] == []
    assert old["llama"] == {"version": "", "backend": "", "rpc_protocol": ""}
