"""Hardware discovery and telemetry for the node agent.

CPU, memory and disk come from ``psutil``; NVIDIA GPUs from NVML through ``pynvml``
(package ``nvidia-ml-py``). A machine without NVML — the module missing, the shared library
missing, no driver, no device, any ``NVMLError`` — simply reports no GPUs. The compute devices
are llama.cpp's (:mod:`agent.runtime.llama_devices`), with NVML merged in
(:mod:`agent.node.node_devices`).

Everything here works on Linux, macOS and Windows (no POSIX-only calls on the main path).
Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from agent.node.node_devices import DeviceInfo, DeviceSample, device_telemetry, node_devices
from agent.runtime.llama_devices import LlamaRuntime
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

_CPUINFO = Path("/proc/cpuinfo")
# Keys that name the CPU in /proc/cpuinfo: x86 ("model name"), some ARM/POWER/RISC-V kernels.
_CPUINFO_MODEL_KEYS = ("model name", "hardware", "processor", "cpu model", "cpu", "uarch")


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int
    driver_version: str

    def to_proto(self) -> pb.Gpu:
        """The ``Gpu`` message: it has exactly this GPU's fields, by the same names."""
        return pb.Gpu(**asdict(self))


@dataclass(frozen=True)
class Inventory:
    hostname: str
    os: str
    arch: str
    cpu_model: str
    cpu_cores: int
    cpu_threads: int
    ram_total_bytes: int
    disk_total_bytes: int
    disk_free_bytes: int
    gpus: tuple[GpuInfo, ...]
    advertised_address: str
    rpc_port: int
    labels: Mapping[str, str] = field(default_factory=dict)
    #: What a new model file may take in the models directory (None: not looked at).
    models_free_bytes: int | None = None
    #: The compute devices as llama.cpp sees them, the host CPU last (empty: no llama.cpp).
    devices: tuple[DeviceInfo, ...] = ()
    llama_version: str = ""
    rpc_protocol: str = ""
    llama_backend: str = ""

    def to_proto(self) -> pb.Inventory:
        return pb.Inventory(
            devices=[device.to_proto() for device in self.devices],
            llama_version=self.llama_version,
            rpc_protocol=self.rpc_protocol,
            llama_backend=self.llama_backend,
            models_free_bytes=self.models_free_bytes,
            hostname=self.hostname,
            os=self.os,
            arch=self.arch,
            cpu_model=self.cpu_model,
            cpu_cores=self.cpu_cores,
            cpu_threads=self.cpu_threads,
            ram_total_bytes=self.ram_total_bytes,
            disk_total_bytes=self.disk_total_bytes,
            disk_free_bytes=self.disk_free_bytes,
            gpus=[gpu.to_proto() for gpu in self.gpus],
            advertised_address=self.advertised_address,
            rpc_port=self.rpc_port,
            labels=dict(self.labels),
        )


@dataclass(frozen=True)
class GpuTelemetry:
    """One GPU's memory and temperature as NVML reads them now, for a heartbeat."""

    index: int
    memory_free_bytes: int
    memory_used_bytes: int
    temperature_c: float | None = None

    def to_proto(self) -> pb.GpuTelemetry:
        msg = pb.GpuTelemetry(
            index=self.index,
            memory_free_bytes=self.memory_free_bytes,
            memory_used_bytes=self.memory_used_bytes,
        )
        if self.temperature_c is not None:
            msg.temperature_c = self.temperature_c
        return msg


@dataclass(frozen=True)
class Telemetry:
    cpu_percent: float
    ram_free_bytes: int
    gpus: tuple[GpuTelemetry, ...] = ()
    devices: tuple[DeviceSample, ...] = ()

    def to_proto(
        self, active_job_ids: Sequence[str] = (), sent_at_unix_ms: int | None = None
    ) -> pb.Heartbeat:
        """The heartbeat message carrying this sample."""
        return pb.Heartbeat(
            sent_at_unix_ms=int(time.time() * 1000) if sent_at_unix_ms is None else sent_at_unix_ms,
            cpu_percent=self.cpu_percent,
            ram_free_bytes=self.ram_free_bytes,
            gpus=[gpu.to_proto() for gpu in self.gpus],
            active_job_ids=list(active_job_ids),
            devices=[device.to_proto() for device in self.devices],
        )


# ---------------------------------------------------------------------------
# NVML
# ---------------------------------------------------------------------------


def _load_nvml(nvml_module: Any | None) -> Any | None:
    if nvml_module is not None:
        return nvml_module
    try:
        import pynvml
    except ImportError:  # nvidia-ml-py not installed
        return None
    return pynvml


def _text(value: Any) -> str:
    # Old pynvml versions return bytes, new ones str.
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


class _NvmlSession:
    """``with _NvmlSession(module) as nvml:`` yields the initialised module, or None when
    NVML is unusable here. Never raises for a missing or broken NVML."""

    def __init__(self, nvml_module: Any | None) -> None:
        self._module = _load_nvml(nvml_module)
        self._active = False

    def __enter__(self) -> Any | None:
        if self._module is None:
            return None
        try:
            self._module.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, OSError, ...
            log.debug("NVML unavailable, reporting no GPUs: %s", exc)
            return None
        self._active = True
        return self._module

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._active and self._module is not None:
            self._active = False
            try:
                self._module.nvmlShutdown()
            except Exception as shutdown_exc:
                log.debug("nvmlShutdown failed: %s", shutdown_exc)


def _device_handles(nvml: Any) -> list[tuple[int, Any]]:
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception as exc:
        log.warning("NVML device count failed, reporting no GPUs: %s", exc)
        return []
    handles: list[tuple[int, Any]] = []
    for index in range(count):
        try:
            handles.append((index, nvml.nvmlDeviceGetHandleByIndex(index)))
        except Exception as exc:  # e.g. GPU fell off the bus, insufficient permissions
            log.warning("NVML cannot open GPU %d, skipping it: %s", index, exc)
    return handles


def _temperature(nvml: Any, handle: Any) -> float | None:
    try:
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        return float(nvml.nvmlDeviceGetTemperature(handle, sensor))
    except Exception:
        return None


def discover_gpus(nvml_module: Any | None = None) -> tuple[GpuInfo, ...]:
    """NVIDIA GPUs visible through NVML; empty when there is no usable NVML."""
    with _NvmlSession(nvml_module) as nvml:
        if nvml is None:
            return ()
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            driver = ""
        gpus: list[GpuInfo] = []
        for index, handle in _device_handles(nvml):
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(
                    GpuInfo(
                        index=index,
                        name=_text(nvml.nvmlDeviceGetName(handle)),
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        memory_total_bytes=int(memory.total),
                        memory_free_bytes=int(memory.free),
                        driver_version=driver,
                    )
                )
            except Exception as exc:
                log.warning("NVML query of GPU %d failed, skipping it: %s", index, exc)
        return tuple(gpus)


def sample_gpu_telemetry(nvml_module: Any | None = None) -> tuple[GpuTelemetry, ...]:
    """Per-GPU memory and temperature; empty when there is no usable NVML."""
    with _NvmlSession(nvml_module) as nvml:
        if nvml is None:
            return ()
        samples: list[GpuTelemetry] = []
        for index, handle in _device_handles(nvml):
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:
                log.debug("NVML memory query of GPU %d failed: %s", index, exc)
                continue
            samples.append(
                GpuTelemetry(
                    index=index,
                    memory_free_bytes=int(memory.free),
                    memory_used_bytes=int(memory.used),
                    temperature_c=_temperature(nvml, handle),
                )
            )
        return tuple(samples)


# ---------------------------------------------------------------------------
# CPU, memory, disk
# ---------------------------------------------------------------------------


def parse_cpuinfo_model(text: str) -> str:
    """The CPU model named in a Linux ``/proc/cpuinfo`` text, or "" if none is."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        value = value.strip()
        # On x86 "processor" is the CPU number; only a non-numeric value names the CPU.
        if key in _CPUINFO_MODEL_KEYS and value and not value.isdigit() and key not in found:
            found[key] = value
    for key in _CPUINFO_MODEL_KEYS:
        if key in found:
            return found[key]
    return ""


def cpu_model(cpuinfo_path: Path = _CPUINFO) -> str:
    """Human-readable CPU model: /proc/cpuinfo on Linux, else ``platform.processor()``."""
    if sys.platform.startswith("linux"):
        try:
            model = parse_cpuinfo_model(cpuinfo_path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            model = ""
        if model:
            return model
    return platform.processor() or platform.machine() or "unknown"


def _cpu_counts() -> tuple[int, int]:
    threads = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    cores = psutil.cpu_count(logical=False) or threads
    return int(cores), int(threads)


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its closest existing parent (the data dir may not exist yet)."""
    current = path.expanduser().absolute()
    while not current.exists() and current.parent != current:
        current = current.parent
    return current


def disk_usage(path: Path | str) -> tuple[int, int]:
    """(total, free) bytes of the filesystem holding ``path``; (0, 0) if unreadable."""
    try:
        usage = psutil.disk_usage(str(_existing_ancestor(Path(path))))
    except OSError as exc:
        log.warning("cannot read disk usage of %s: %s", path, exc)
        return 0, 0
    return int(usage.total), int(usage.free)


def _os_description() -> str:
    system = platform.system() or sys.platform
    release = platform.release()
    return f"{system} {release}".strip()


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def discover_inventory(
    data_dir: Path | str,
    models_dir: Path | str,
    advertised_address: str,
    rpc_port: int,
    labels: Mapping[str, str] | None = None,
    *,
    nvml_module: Any | None = None,
    llama: LlamaRuntime | None = None,
) -> Inventory:
    """Everything the controller needs to place work on this node.

    Disk figures are for the filesystem holding ``data_dir``. ``models_dir`` is accepted so
    callers pass the agent's layout in one place; the models themselves are reported by
    :mod:`agent.models.model_store`. ``nvml_module`` replaces ``pynvml`` (tests inject a fake).
    ``llama`` is what the llama.cpp build said of itself (:class:`agent.runtime.llama_devices.
    LlamaProbe`); without it the node lists no devices (it runs no llama.cpp).
    """
    del models_dir  # see docstring
    cores, threads = _cpu_counts()
    disk_total, disk_free = disk_usage(data_dir)
    memory = psutil.virtual_memory()
    model = cpu_model()
    gpus = discover_gpus(nvml_module)
    devices: tuple[DeviceInfo, ...] = ()
    if llama is not None:
        devices = node_devices(
            llama.devices,
            gpus,
            cpu_description=model,
            ram_total_bytes=int(memory.total),
            ram_free_bytes=int(memory.available),
        )
    return Inventory(
        hostname=socket.gethostname(),
        os=_os_description(),
        arch=platform.machine(),
        cpu_model=model,
        cpu_cores=cores,
        cpu_threads=threads,
        ram_total_bytes=int(memory.total),
        disk_total_bytes=disk_total,
        disk_free_bytes=disk_free,
        gpus=gpus,
        advertised_address=advertised_address,
        rpc_port=rpc_port,
        labels=dict(labels or {}),
        devices=devices,
        llama_version=llama.version if llama is not None else "",
        rpc_protocol=llama.rpc_protocol if llama is not None else "",
        llama_backend=llama.backend if llama is not None else "",
    )


def sample_telemetry(
    *, nvml_module: Any | None = None, devices: Sequence[DeviceInfo] = ()
) -> Telemetry:
    """A heartbeat sample, with the free memory of ``devices`` (the last inventory's). It
    starts no process. ``cpu_percent`` is the utilisation since the previous call (the very
    first call in a process returns 0.0), so it never blocks."""
    ram_free = int(psutil.virtual_memory().available)
    gpus = sample_gpu_telemetry(nvml_module)
    return Telemetry(
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        ram_free_bytes=ram_free,
        gpus=gpus,
        devices=device_telemetry(devices, gpus, ram_free),
    )
