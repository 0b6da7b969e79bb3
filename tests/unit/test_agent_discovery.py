"""agent.node.discovery: the real no-GPU path of this machine, and the GPU path via a fake NVML."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.agent_config import AgentConfig
from agent.handler_factory import resolve_binaries
from agent.node import discovery
from agent.node.discovery import (
    GpuInfo,
    GpuTelemetry,
    Telemetry,
    discover_inventory,
    parse_cpuinfo_model,
    sample_telemetry,
)
from agent.node.node_devices import DeviceInfo, DeviceSample, node_devices
from agent.node.resources import ResourceCollector, Resources
from agent.runtime.llama_devices import MIB, ListedDevice, LlamaProbe, LlamaRuntime
from common.contract import DEVICE_CPU, DEVICE_GPU, HOST_DEVICE
from wire import control_pb2 as pb

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


# --- devices as llama.cpp sees them, NVML merged in ----------------------------------------


def cuda(index: int, name: str, total_mib: int, free_mib: int) -> ListedDevice:
    return ListedDevice(f"CUDA{index}", name, total_mib * MIB, free_mib * MIB)


def runtime(*devices: ListedDevice) -> LlamaRuntime:
    return LlamaRuntime("cuda", "4567 (abc1234)", "7.0.0", devices)


# llama.cpp's CUDA figures are a little below NVML's (the driver keeps some).
RTX_4090 = cuda(0, "NVIDIA GeForce RTX 4090", 24080, 23700)
A4000 = cuda(1, "NVIDIA RTX A4000", 16000, 15900)


def test_two_gpus_are_two_devices_with_nvml_merged_in_and_the_cpu_last(tmp_path: Path) -> None:
    fake = FakeNvmlModule(two_fake_gpus())
    inv = discover_inventory(
        tmp_path, tmp_path, "10.0.0.5", 50052, nvml_module=fake, llama=runtime(RTX_4090, A4000)
    )
    gpu0, gpu1, host = inv.devices
    assert gpu0 == DeviceInfo(
        "CUDA0", "NVIDIA GeForce RTX 4090", DEVICE_GPU, 24080 * MIB, 20 * GIB, "GPU-aaaa", 0
    )
    # NVML's free memory, never beyond what llama.cpp says the device has.
    assert gpu1 == DeviceInfo(
        "CUDA1", "NVIDIA RTX A4000", DEVICE_GPU, 16000 * MIB, 16000 * MIB, "GPU-bbbb", 1
    )
    assert (host.name, host.kind, host.uuid) == (HOST_DEVICE, DEVICE_CPU, "")
    assert (host.description, host.memory_total_bytes) == (inv.cpu_model, inv.ram_total_bytes)
    assert 0 < host.memory_free_bytes <= host.memory_total_bytes
    assert (inv.llama_version, inv.rpc_protocol, inv.llama_backend) == (
        "4567 (abc1234)",
        "7.0.0",
        "cuda",
    )
    assert len(inv.gpus) == 2  # NVML's own view stays as it was
    msg = pb.Inventory.FromString(inv.to_proto().SerializeToString())
    assert [(d.name, d.kind, d.uuid) for d in msg.devices] == [
        ("CUDA0", "gpu", "GPU-aaaa"),
        ("CUDA1", "gpu", "GPU-bbbb"),
        ("CPU", "cpu", ""),
    ]
    assert msg.devices[0].memory_free_bytes == 20 * GIB
    assert (msg.llama_version, msg.rpc_protocol, msg.llama_backend) == (
        "4567 (abc1234)",
        "7.0.0",
        "cuda",
    )


def test_no_llama_cpp_no_devices(tmp_path: Path) -> None:
    fake = FakeNvmlModule(two_fake_gpus())
    inv = discover_inventory(tmp_path, tmp_path, "10.0.0.5", 50052, nvml_module=fake)
    assert inv.devices == () and len(inv.gpus) == 2
    assert (inv.llama_version, inv.rpc_protocol, inv.llama_backend) == ("", "", "")


def test_a_cpu_build_has_the_host_cpu_only(tmp_path: Path) -> None:
    """This machine's build lists no device: the node computes on its CPU, even with GPUs
    that NVML sees (the build cannot use them)."""
    fake = FakeNvmlModule(two_fake_gpus())
    cpu_build = LlamaRuntime("cpu", "1", "7.0.0", ())
    inv = discover_inventory(
        tmp_path, tmp_path, "10.0.0.5", 50052, nvml_module=fake, llama=cpu_build
    )
    assert [(d.name, d.kind) for d in inv.devices] == [(HOST_DEVICE, DEVICE_CPU)]


def gpu(index: int, name: str, uuid: str, total_gib: int, free_gib: int) -> GpuInfo:
    return GpuInfo(index, name, uuid, total_gib * GIB, free_gib * GIB, "550")


GPUS = (
    gpu(0, "NVIDIA RTX A4000", "GPU-bbbb", 16, 10),
    gpu(1, "NVIDIA GeForce RTX 4090", "GPU-aaaa", 24, 20),
)


def merged(listed: list[ListedDevice], gpus: tuple[GpuInfo, ...], visible: list[str]) -> list[str]:
    devices = node_devices(
        listed,
        gpus,
        cpu_description="cpu",
        ram_total_bytes=8 * GIB,
        ram_free_bytes=4 * GIB,
        visible=visible or None,
    )
    return [f"{d.name}={d.uuid}" for d in devices]


def test_cuda_orders_its_gpus_fastest_first_nvml_by_bus_the_names_decide() -> None:
    assert merged([RTX_4090, A4000], GPUS, []) == [
        "CUDA0=GPU-aaaa",
        "CUDA1=GPU-bbbb",
        "CPU=",
    ]


def test_cuda_visible_devices_maps_cuda_indices_to_nvml_ones() -> None:
    twins = (gpu(0, "NVIDIA H100", "GPU-0000", 80, 80), gpu(1, "NVIDIA H100", "GPU-1111", 80, 70))
    only = [cuda(0, "NVIDIA H100", 81000, 70000)]
    assert merged(only, twins, []) == ["CUDA0=GPU-0000", "CPU="]
    assert merged(only, twins, ["1"]) == ["CUDA0=GPU-1111", "CPU="]
    assert merged(only, twins, ["GPU-1111"]) == ["CUDA0=GPU-1111", "CPU="]


def test_only_what_llama_cpp_lists_is_a_device() -> None:
    """A GPU NVML sees that the build does not list is no device; a listed device NVML does
    not know keeps llama.cpp's figures; one without memory of its own (BLAS) is none."""
    vulkan = ListedDevice("Vulkan0", "AMD Radeon RX 7900 XTX", 24 * GIB, 23 * GIB)
    blas = ListedDevice("BLAS", "OpenBLAS", 0, 0)
    devices = node_devices(
        [vulkan, blas], GPUS, cpu_description="cpu", ram_total_bytes=8 * GIB, ram_free_bytes=GIB
    )
    assert devices == (
        DeviceInfo("Vulkan0", "AMD Radeon RX 7900 XTX", DEVICE_GPU, 24 * GIB, 23 * GIB),
        DeviceInfo(HOST_DEVICE, "cpu", DEVICE_CPU, 8 * GIB, GIB),
    )
    # A Vulkan device of an NVIDIA GPU is still that GPU: NVML's by name.
    nvidia = ListedDevice("Vulkan0", "NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB)
    assert merged([nvidia], GPUS, []) == ["Vulkan0=GPU-aaaa", "CPU="]
    # A name NVML does not know, at CUDA's index: that GPU if its memory agrees.
    renamed = cuda(1, "GeForce 4090 (MIG)", 24000, 20000)
    assert merged([renamed], GPUS, []) == ["CUDA1=GPU-aaaa", "CPU="]
    assert merged([cuda(1, "Other", 4000, 4000)], GPUS, []) == ["CUDA1=", "CPU="]


def test_heartbeats_carry_each_devices_free_memory_now() -> None:
    """NVML's figure now for the GPUs it knows, the available RAM for the CPU, the listed
    figure for the others; nothing is run for it."""
    nvml = two_fake_gpus()
    fake = FakeNvmlModule(nvml)
    rpc_like = ListedDevice("Vulkan0", "Some iGPU", 2 * GIB, GIB)
    devices = node_devices(
        [RTX_4090, rpc_like],
        discovery.discover_gpus(fake),
        cpu_description="cpu",
        ram_total_bytes=1 << 50,
        ram_free_bytes=GIB,
    )
    nvml[0]["used"] = 10 * GIB  # a model loaded since the inventory
    sample = sample_telemetry(nvml_module=fake, devices=devices)
    assert sample.devices == (
        DeviceSample("CUDA0", 14 * GIB),
        DeviceSample("Vulkan0", GIB),
        DeviceSample(HOST_DEVICE, sample.ram_free_bytes),
    )
    heartbeat = pb.Heartbeat.FromString(sample.to_proto().SerializeToString())
    assert [(d.name, d.memory_free_bytes) for d in heartbeat.devices] == [
        ("CUDA0", 14 * GIB),
        ("Vulkan0", GIB),
        ("CPU", sample.ram_free_bytes),
    ]
    assert sample_telemetry(nvml_module=fake).devices == ()


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


# --- the resource collector: one probe of the build, heartbeats from its devices ------------


def fake_build(bin_dir: Path) -> Path:
    """A llama.cpp build of two scripts that answer as a CPU build does."""
    bin_dir.mkdir()
    server = bin_dir / "llama-server"
    server.write_text(
        "#!/bin/sh\n"
        'case "$1" in --version) echo "version: 1 (fake)" >&2;;'
        ' *) printf "Available devices:\\n  (none)\\n";; esac\n'
    )
    rpc = bin_dir / "ggml-rpc-server"
    rpc.write_text('#!/bin/sh\necho "Starting RPC server v7.0.0"\n')
    for path in (server, rpc):
        path.chmod(0o755)
    return bin_dir


def collector_for(tmp_path: Path, **config: Any) -> tuple[ResourceCollector, LlamaProbe]:
    probe = LlamaProbe()
    agent = AgentConfig(data_dir=tmp_path / "data", node_name="n", **config)
    return ResourceCollector(agent, FakeNvmlModule([]), probe), probe


def test_the_collector_asks_the_build_once_and_heartbeats_read_its_devices(
    tmp_path: Path,
) -> None:
    bin_dir = fake_build(tmp_path / "bin")
    collector, probe = collector_for(tmp_path, llama_runtime=True, llama_bin_dir=bin_dir)
    assert collector.telemetry().devices == ()  # no inventory yet
    inv = collector.collect_sync().inventory
    assert [d.name for d in inv.devices] == [HOST_DEVICE]
    assert (inv.llama_version, inv.rpc_protocol) == ("1 (fake)", "7.0.0")
    assert inv.llama_backend == resolve_binaries(collector.config).backend
    collector.collect_sync()
    assert probe.probes == 1
    (cpu,) = collector.telemetry().devices
    assert cpu.name == HOST_DEVICE and cpu.memory_free_bytes > 0


def test_without_a_runtime_the_build_is_not_asked(tmp_path: Path) -> None:
    collector, probe = collector_for(tmp_path, llama_runtime=False)
    inv = collector.collect_sync().inventory
    assert inv.devices == () and inv.llama_version == "" and probe.probes == 0


def test_missing_binaries_are_logged_once_and_list_no_device(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    collector, probe = collector_for(
        tmp_path, llama_runtime=True, llama_bin_dir=tmp_path / "nowhere"
    )
    assert collector.collect_sync().inventory.devices == ()
    assert collector.collect_sync().inventory.devices == ()
    assert probe.probes == 0
    warnings = [r for r in caplog.records if "no llama.cpp devices" in r.getMessage()]
    assert len(warnings) == 1


def test_free_memory_of_devices_is_no_change_worth_a_report(tmp_path: Path) -> None:
    fake = FakeNvmlModule(two_fake_gpus())
    inv = discover_inventory(
        tmp_path, tmp_path, "10.0.0.5", 50052, nvml_module=fake, llama=runtime(RTX_4090, A4000)
    )
    before = Resources(inv, ())
    freer = tuple(dataclasses.replace(d, memory_free_bytes=1) for d in inv.devices)
    assert Resources(dataclasses.replace(inv, devices=freer), ()).fingerprint() == (
        before.fingerprint()
    )
    fewer = Resources(dataclasses.replace(inv, devices=inv.devices[1:]), ())
    assert fewer.fingerprint() != before.fingerprint()
    upgraded = Resources(dataclasses.replace(inv, llama_version="4568 (def)"), ())
    assert upgraded.fingerprint() != before.fingerprint()
