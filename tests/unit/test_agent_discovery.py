"""agent.discovery: the real no-GPU path of this machine, and the GPU path via a fake NVML."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent import discovery
from agent.discovery import (
    GpuInfo,
    GpuTelemetry,
    Telemetry,
    discover_inventory,
    parse_cpuinfo_model,
    sample_telemetry,
)
from proto import control_pb2 as pb

GIB = 1024**3


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError."""


class FakeNvmlModule:
    """A fake of the parts of ``pynvml`` discovery uses. Not NVIDIA code; test only."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(
        self,
        devices: list[dict[str, Any]],
        *,
        init_error: Exception | None = None,
        bytes_strings: bool = False,
    ) -> None:
        self.devices = devices
        self.init_error = init_error
        self.bytes_strings = bytes_strings
        self.init_calls = 0
        self.shutdown_calls = 0

    def _s(self, value: str) -> str | bytes:
        return value.encode() if self.bytes_strings else value

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self._s("550.54.15")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        device = self.devices[index]
        if device.get("handle_error"):
            raise FakeNvmlError("GPU is lost")
        return device

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> str | bytes:
        return self._s(handle["name"])

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> str | bytes:
        return self._s(handle["uuid"])

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        total, used = handle["total"], handle["used"]
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetTemperature(self, handle: dict[str, Any], sensor: int) -> int:
        if handle.get("temperature") is None:
            raise FakeNvmlError("Not Supported")
        return int(handle["temperature"])


def two_fake_gpus() -> list[dict[str, Any]]:
    return [
        {
            "name": "NVIDIA GeForce RTX 4090",
            "uuid": "GPU-aaaa",
            "total": 24 * GIB,
            "used": 4 * GIB,
            "temperature": 61,
        },
        {
            "name": "NVIDIA RTX A4000",
            "uuid": "GPU-bbbb",
            "total": 16 * GIB,
            "used": 0,
            "temperature": None,
        },
    ]


# --- the real path on this machine (no NVIDIA GPU, no libnvidia-ml) ---------------------


def test_real_inventory_on_this_machine(tmp_path: Path) -> None:
    inv = discover_inventory(
        data_dir=tmp_path / "not-created-yet" / "data",
        models_dir=tmp_path / "models",
        advertised_address="10.0.0.5",
        rpc_port=50052,
        labels={"zone": "lab"},
    )
    assert inv.hostname
    assert inv.os and inv.arch and inv.cpu_model
    assert inv.cpu_cores >= 1
    assert inv.cpu_threads >= inv.cpu_cores
    assert inv.ram_total_bytes > 0
    assert inv.disk_total_bytes >= inv.disk_free_bytes > 0
    assert inv.gpus == ()  # this machine has no usable NVML
    assert (inv.advertised_address, inv.rpc_port, dict(inv.labels)) == (
        "10.0.0.5",
        50052,
        {"zone": "lab"},
    )


def test_real_inventory_to_proto(tmp_path: Path) -> None:
    inv = discover_inventory(tmp_path, tmp_path, "192.168.1.7", 50052, {"a": "b"})
    msg = inv.to_proto()
    decoded = pb.Inventory.FromString(msg.SerializeToString())
    assert decoded.hostname == inv.hostname
    assert decoded.cpu_cores == inv.cpu_cores
    assert decoded.cpu_threads == inv.cpu_threads
    assert decoded.ram_total_bytes == inv.ram_total_bytes
    assert decoded.disk_free_bytes == inv.disk_free_bytes
    assert list(decoded.gpus) == []
    assert dict(decoded.labels) == {"a": "b"}
    assert decoded.advertised_address == "192.168.1.7"


def test_real_telemetry_on_this_machine() -> None:
    sample_telemetry()  # primes psutil's cpu_percent baseline
    sample = sample_telemetry()
    assert 0.0 <= sample.cpu_percent <= 100.0
    assert sample.ram_free_bytes > 0
    assert sample.gpus == ()
    heartbeat = sample.to_proto(active_job_ids=["j1"], sent_at_unix_ms=1234)
    assert heartbeat.sent_at_unix_ms == 1234
    assert list(heartbeat.active_job_ids) == ["j1"]
    assert heartbeat.ram_free_bytes == sample.ram_free_bytes
    assert sample.to_proto().sent_at_unix_ms > 0


def test_real_pynvml_is_importable_but_reports_no_gpu() -> None:
    # nvidia-ml-py is a dependency, so pynvml imports; libnvidia-ml.so is absent: nvmlInit raises.
    import pynvml

    assert callable(pynvml.nvmlInit)
    assert discovery.discover_gpus() == ()
    assert discovery.sample_gpu_telemetry() == ()


def test_missing_pynvml_module_reports_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert discovery.discover_gpus() == ()
    assert sample_telemetry().gpus == ()


@pytest.mark.parametrize(
    "error", [FakeNvmlError("NVML Shared Library Not Found"), OSError("libnvidia-ml.so.1")]
)
def test_nvml_init_failure_reports_no_gpu(tmp_path: Path, error: Exception) -> None:
    fake = FakeNvmlModule(two_fake_gpus(), init_error=error)
    inv = discover_inventory(tmp_path, tmp_path, "10.0.0.5", 50052, nvml_module=fake)
    assert inv.gpus == ()
    assert sample_telemetry(nvml_module=fake).gpus == ()
    assert fake.shutdown_calls == 0


# --- the GPU path through a fake NVML ---------------------------------------------------


@pytest.mark.parametrize("bytes_strings", [False, True])
def test_fake_nvml_gpus_in_inventory(tmp_path: Path, bytes_strings: bool) -> None:
    fake = FakeNvmlModule(two_fake_gpus(), bytes_strings=bytes_strings)
    inv = discover_inventory(tmp_path, tmp_path, "10.0.0.5", 50052, nvml_module=fake)
    assert inv.gpus == (
        GpuInfo(0, "NVIDIA GeForce RTX 4090", "GPU-aaaa", 24 * GIB, 20 * GIB, "550.54.15"),
        GpuInfo(1, "NVIDIA RTX A4000", "GPU-bbbb", 16 * GIB, 16 * GIB, "550.54.15"),
    )
    assert fake.init_calls == fake.shutdown_calls == 1
    msg = inv.to_proto()
    assert [(g.index, g.name, g.uuid, g.memory_total_bytes) for g in msg.gpus] == [
        (0, "NVIDIA GeForce RTX 4090", "GPU-aaaa", 24 * GIB),
        (1, "NVIDIA RTX A4000", "GPU-bbbb", 16 * GIB),
    ]
    assert msg.gpus[0].driver_version == "550.54.15"


def test_fake_nvml_lost_gpu_is_skipped(tmp_path: Path) -> None:
    devices = two_fake_gpus()
    devices[0]["handle_error"] = True
    fake = FakeNvmlModule(devices)
    gpus = discovery.discover_gpus(fake)
    assert [g.uuid for g in gpus] == ["GPU-bbbb"]
    assert fake.shutdown_calls == 1


def test_fake_nvml_telemetry_with_and_without_temperature() -> None:
    fake = FakeNvmlModule(two_fake_gpus())
    sample = sample_telemetry(nvml_module=fake)
    assert sample.gpus == (
        GpuTelemetry(
            index=0, memory_free_bytes=20 * GIB, memory_used_bytes=4 * GIB, temperature_c=61.0
        ),
        GpuTelemetry(index=1, memory_free_bytes=16 * GIB, memory_used_bytes=0, temperature_c=None),
    )
    heartbeat = pb.Heartbeat.FromString(sample.to_proto(["a", "b"]).SerializeToString())
    assert heartbeat.gpus[0].HasField("temperature_c")
    assert heartbeat.gpus[0].temperature_c == 61.0
    assert not heartbeat.gpus[1].HasField("temperature_c")
    assert heartbeat.gpus[1].memory_free_bytes == 16 * GIB
    assert list(heartbeat.active_job_ids) == ["a", "b"]


def test_telemetry_dataclass_to_proto_without_gpus() -> None:
    msg = Telemetry(cpu_percent=12.5, ram_free_bytes=GIB).to_proto(sent_at_unix_ms=5)
    assert (msg.cpu_percent, msg.ram_free_bytes, msg.sent_at_unix_ms) == (12.5, GIB, 5)
    assert list(msg.gpus) == []


def test_discover_inventory_copies_labels(tmp_path: Path) -> None:
    labels = {"k": "v"}
    inv = discover_inventory(tmp_path, tmp_path, "10.0.0.1", 50052, labels)
    labels["k"] = "changed"
    assert dict(inv.labels) == {"k": "v"}
    assert dict(inv.to_proto().labels) == {"k": "v"}


# --- CPU model parsing --------------------------------------------------------------------


def test_parse_cpuinfo_x86() -> None:
    text = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\n"
        "model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n"
    )
    assert parse_cpuinfo_model(text) == "Intel(R) Xeon(R) CPU @ 2.20GHz"


def test_parse_cpuinfo_arm_and_empty() -> None:
    arm = "processor\t: 0\nBogoMIPS\t: 38.40\nHardware\t: BCM2835\nModel\t: Raspberry Pi 4\n"
    assert parse_cpuinfo_model(arm) == "BCM2835"
    assert parse_cpuinfo_model("processor\t: 0\nCPU part\t: 0xd0c\n") == ""
    assert parse_cpuinfo_model("") == ""


def test_cpu_model_falls_back_when_cpuinfo_unreadable(tmp_path: Path) -> None:
    assert discovery.cpu_model(tmp_path / "no-such-cpuinfo")


def test_disk_usage_of_missing_dir_uses_existing_parent(tmp_path: Path) -> None:
    total, free = discovery.disk_usage(tmp_path / "a" / "b" / "c")
    assert total >= free > 0
