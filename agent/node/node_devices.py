"""The node's compute devices as the agent reports them: what llama.cpp lists
(:mod:`agent.runtime.llama_devices`), NVML merged in where it knows the GPU, and the host CPU last.

- A listed device is a GPU (kind ``gpu``) unless it has no memory of its own (llama.cpp's BLAS,
  for one): those are left out. A node with two GPUs has two devices.
- A listed GPU that NVML knows gets NVML's UUID, and its free memory from NVML now and in every
  heartbeat (:func:`device_telemetry`). ``CUDA<i>`` is NVML's GPU ``i`` (through
  ``$CUDA_VISIBLE_DEVICES`` when set) if the names agree; otherwise the same name with the
  closest total memory. A GPU NVML sees but llama.cpp does not list is no device: this build
  cannot use it (it stays in the inventory's ``gpus``).
- The host CPU is the device llama.cpp calls ``CPU`` (:data:`common.contract.HOST_DEVICE`), kind
  ``cpu``, with the RAM as its memory (free: available RAM).

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.runtime.llama_devices import ListedDevice
from common.contract import DEVICE_CPU, DEVICE_GPU, HOST_DEVICE
from wire import control_pb2 as pb

if TYPE_CHECKING:
    from agent.node.discovery import GpuInfo, GpuTelemetry

_CUDA_NAME = re.compile(r"CUDA(\d+)")
#: How far (relative) CUDA's total memory of a GPU may be from NVML's and still be that GPU
#: when the names disagree (CUDA reports a little less than NVML).
_SAME_MEMORY = 0.10


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    name: str
    description: str
    kind: str
    memory_total_bytes: int
    memory_free_bytes: int
    uuid: str = ""
    #: NVML's index of this GPU, where NVML knows it (not reported: heartbeats read it).
    nvml_index: int | None = None

    def to_proto(self) -> pb.Device:
        return pb.Device(
            name=self.name,
            description=self.description,
            kind=self.kind,
            memory_total_bytes=self.memory_total_bytes,
            memory_free_bytes=self.memory_free_bytes,
            uuid=self.uuid,
        )


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """A device's free memory now (a heartbeat's ``DeviceTelemetry``)."""

    name: str
    memory_free_bytes: int

    def to_proto(self) -> pb.DeviceTelemetry:
        return pb.DeviceTelemetry(name=self.name, memory_free_bytes=self.memory_free_bytes)


def cuda_visible_devices(env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """``$CUDA_VISIBLE_DEVICES`` as entries (indices or UUIDs), or None when it is not set."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _nvml_slot(name: str, visible: Sequence[str] | None, gpus: Sequence[GpuInfo]) -> int | None:
    """NVML's index of llama.cpp's ``CUDA<i>`` by position (None: not a CUDA name, or not
    known)."""
    match = _CUDA_NAME.fullmatch(name)
    if match is None:
        return None
    position = int(match[1])
    if visible is None:
        return position
    if position >= len(visible):
        return None
    entry = visible[position]
    if entry.isdigit():
        return int(entry)
    for gpu in gpus:  # a UUID (or its prefix, as CUDA allows)
        if gpu.uuid and gpu.uuid.startswith(entry):
            return gpu.index
    return None


def _same_name(a: str, b: str) -> bool:
    return a.strip().casefold() == b.strip().casefold()


def _close_memory(listed: ListedDevice, gpu: GpuInfo) -> bool:
    total = max(gpu.memory_total_bytes, 1)
    return abs(listed.memory_total_bytes - gpu.memory_total_bytes) <= _SAME_MEMORY * total


def match_nvml(
    listed: Sequence[ListedDevice],
    gpus: Sequence[GpuInfo],
    visible: Sequence[str] | None = None,
) -> dict[str, GpuInfo]:
    """NVML's GPU for each listed device it knows, by device name; each GPU at most once."""
    unused = list(gpus)
    matched: dict[str, GpuInfo] = {}
    for device in listed:
        slot = _nvml_slot(device.name, visible, gpus)
        by_slot = next((g for g in unused if g.index == slot), None)
        named = [g for g in unused if _same_name(g.name, device.description)]
        if by_slot is not None and (by_slot in named or _close_memory(device, by_slot)):
            found: GpuInfo | None = by_slot
        elif named:
            found = min(named, key=lambda g: abs(g.memory_total_bytes - device.memory_total_bytes))
        else:
            found = None
        if found is not None:
            matched[device.name] = found
            unused.remove(found)
    return matched


def node_devices(
    listed: Sequence[ListedDevice],
    gpus: Sequence[GpuInfo],
    *,
    cpu_description: str,
    ram_total_bytes: int,
    ram_free_bytes: int,
    visible: Sequence[str] | None = None,
) -> tuple[DeviceInfo, ...]:
    """The devices to report: the listed ones with memory, NVML merged in, the host CPU last."""
    own = [d for d in listed if d.memory_total_bytes > 0 and d.name != HOST_DEVICE]
    nvml = match_nvml(own, gpus, cuda_visible_devices() if visible is None else visible)
    devices: list[DeviceInfo] = []
    for device in own:
        gpu = nvml.get(device.name)
        free = device.memory_free_bytes
        if gpu is not None:
            free = min(gpu.memory_free_bytes, device.memory_total_bytes)
        devices.append(
            DeviceInfo(
                name=device.name,
                description=device.description,
                kind=DEVICE_GPU,
                memory_total_bytes=device.memory_total_bytes,
                memory_free_bytes=free,
                uuid=gpu.uuid if gpu is not None else "",
                nvml_index=gpu.index if gpu is not None else None,
            )
        )
    devices.append(
        DeviceInfo(
            name=HOST_DEVICE,
            description=cpu_description,
            kind=DEVICE_CPU,
            memory_total_bytes=ram_total_bytes,
            memory_free_bytes=min(ram_free_bytes, ram_total_bytes),
        )
    )
    return tuple(devices)


def device_telemetry(
    devices: Sequence[DeviceInfo], gpus: Sequence[GpuTelemetry], ram_free_bytes: int
) -> tuple[DeviceSample, ...]:
    """Each device's free memory now: NVML's for a GPU it knows, the available RAM for the
    host CPU, the last listed figure for any other (no process is started for a heartbeat)."""
    nvml_free = {g.index: g.memory_free_bytes for g in gpus}
    samples = []
    for device in devices:
        if device.kind == DEVICE_CPU:
            free = ram_free_bytes
        elif device.nvml_index is not None and device.nvml_index in nvml_free:
            free = nvml_free[device.nvml_index]
        else:
            free = device.memory_free_bytes
        samples.append(DeviceSample(device.name, min(free, device.memory_total_bytes)))
    return tuple(samples)
