"""Out-of-memory, as llama.cpp says it, on any backend: which buffer (device) and how many bytes.

llama.cpp has no error code for it; its processes say it in their output. What each backend
prints (llama.cpp 11434):

- any backend, at load: ``failed to allocate CUDA0 buffer of size 1234`` (ggml-backend,
  ggml-alloc), then ``unable to allocate CUDA0 buffer`` (llama-model); the buffer is named for
  its device: ``CUDA0``, ``Vulkan0``, ``Metal``, ``CPU``, ``RPC1[10.0.0.2:50052]``;
- CUDA (and ROCm): ``allocating 512.00 MiB on device 0: cudaMalloc failed: out of memory``,
  and mid-generation ``CUDA error: out of memory`` with ``current device: 0`` after it;
- Vulkan: ``ErrorOutOfDeviceMemory``;
- Metal: ``failed to allocate Metal buffer of N bytes (out of memory)`` or ``failed to
  allocate buffer, size = 512.00 MiB``;
- the host (a CPU buffer, a ``ggml-rpc-server`` under a memory limit):
  ``ggml_aligned_malloc: insufficient memory (attempted to allocate  92.10 MB)``,
  ``failed to allocate buffer of size N``, ``std::bad_alloc``,
  ``failed to allocate buffer for kv cache``, ``failed to allocate compute ... buffers``.

On the primary the buffer's name says whose device ran out (:class:`PlanDevices` maps
``RPC<i>[host:port]`` back to the node and its device: ``i`` counts that server's devices,
while the device *names* ``--device`` takes, ``RPC<k>``, count over every server). The
parsers are pure; :func:`out_of_memory` reads the failed process's log.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent.runtime.endpoints import peer_endpoint
from agent.runtime.runtime_errors import LlamaRuntimeError, RuntimeCrashedError, RuntimeStartError
from common.contract import HOST_DEVICE
from wire import control_pb2 as pb

if TYPE_CHECKING:
    from agent.runtime.llama_server import LlamaServer

_MIB = 1024 * 1024

_BUFFER = re.compile(r"failed to allocate (?P<buffer>\S+) buffer of size (?P<size>\d+)")
_UNABLE = re.compile(r"unable to allocate (?P<buffer>\S+) buffer")
_CUDA_MALLOC = re.compile(
    r"allocating (?P<mib>[\d.]+) MiB on device (?P<device>\d+): \w+ failed: out of memory"
)
_CUDA_ERROR = re.compile(r"(?:CUDA|ROCm|MUSA) error: out of memory")
_CURRENT_DEVICE = re.compile(r"current device: (?P<device>\d+)")
_METAL_BYTES = re.compile(r"failed to allocate Metal buffer of (?P<size>\d+) bytes")
_METAL_MIB = re.compile(r"failed to allocate buffer, size =\s*(?P<mib>[\d.]+) MiB")
_VULKAN = re.compile(r"ErrorOutOfDeviceMemory|OutOfDeviceMemory")
_HOST_MALLOC = re.compile(r"insufficient memory \(attempted to allocate\s+(?P<mb>[\d.]+) MB\)")
_HOST_BUFFER = re.compile(r"failed to allocate buffer of size (?P<size>\d+)")
_HOST_OTHER = re.compile(
    r"std::bad_alloc|failed to allocate buffer for kv cache|failed to allocate compute \w+ "
    r"buffers|Cannot allocate memory|out of memory",
    re.IGNORECASE,
)
_RPC_BUFFER = re.compile(r"^RPC(?P<index>\d+)(?:\[(?P<endpoint>[^\]]+)\])?$")


@dataclass(frozen=True, slots=True)
class MemoryFailure:
    """llama.cpp ran out of memory: in the buffer named ``buffer`` as llama.cpp names it
    ("" when it did not say), asking for ``bytes`` (0 when it did not say)."""

    buffer: str
    bytes: int
    line: str


def find_out_of_memory(lines: Sequence[str]) -> MemoryFailure | None:
    """The out-of-memory in a process's last output, or None. The most specific line wins
    (a named buffer over a bare "out of memory")."""
    buffer, size, line = "", 0, ""
    found = estimated = False
    for text in lines:
        match = _BUFFER.search(text)
        if match:
            buffer, size, line, found = match["buffer"], int(match["size"]), text, True
            continue
        match = _CUDA_MALLOC.search(text)
        if match:
            buffer = f"CUDA{match['device']}"
            size, line, found = int(float(match["mib"]) * _MIB), text, True
            continue
        match = _UNABLE.search(text)
        if match:
            if not buffer:
                buffer, line = match["buffer"], text
            found = True
            continue
        match = _CUDA_ERROR.search(text)
        if match:
            found, line = True, line or text
            continue
        match = _CURRENT_DEVICE.search(text)
        if match and found and not buffer:
            buffer = f"CUDA{match['device']}"
            continue
        match = _METAL_BYTES.search(text) or _METAL_MIB.search(text)
        if match:
            buffer = buffer or "Metal"
            size = int(match["size"]) if "size" in match.groupdict() else _mib(match["mib"])
            line, found = text, True
            continue
        if _VULKAN.search(text):
            found, line = True, line or text
            continue
        match = _HOST_MALLOC.search(text)
        if match:
            buffer = buffer or HOST_DEVICE
            if not size:  # rounded to 0.01 MB: the buffer's exact size may follow
                size, estimated = int(float(match["mb"]) * _MIB), True
            line, found = line or text, True
            continue
        match = _HOST_BUFFER.search(text)
        if match:
            buffer = buffer or HOST_DEVICE
            if not size or estimated:
                size, estimated = int(match["size"]), False
            line, found = line or text, True
            continue
        if _HOST_OTHER.search(text):
            found, line = True, line or text
    if not found:
        return None
    return MemoryFailure(buffer, size, line.strip())


def _mib(value: str) -> int:
    return int(float(value) * _MIB)


@dataclass(frozen=True, slots=True)
class Blame:
    """Whose device ran out: ``node_id`` ("" for this node), the device as its node's
    llama.cpp names it, and the bytes it asked for."""

    node_id: str
    device: str
    bytes: int


class PlanDevices:
    """The primary's llama.cpp device names for a plan's devices: its own by their names,
    a worker's as ``RPC<k>``, numbered in ``--rpc`` order, then in the order each worker
    exposes its devices (``ggml-rpc-server -d``, the plan's order)."""

    def __init__(
        self,
        devices: Sequence[pb.PlanDevice],
        endpoints: Sequence[str],
        endpoint_nodes: Mapping[str, str] | None = None,
    ) -> None:
        self.devices = tuple(devices)
        self.endpoints = tuple(endpoints)
        #: endpoint -> the node whose RPC worker it is (a plan from before devices).
        self.endpoint_nodes = dict(endpoint_nodes or {})
        by_endpoint: dict[str, list[pb.PlanDevice]] = {e: [] for e in self.endpoints}
        for device in self.devices:
            if device.endpoint:
                if device.endpoint not in by_endpoint:
                    raise ValueError(
                        f"device {device.device} of node {device.node_id} is reached at "
                        f"{device.endpoint}, which is not among the plan's RPC workers"
                    )
                by_endpoint[device.endpoint].append(device)
        #: RPC<k> -> the plan device it is.
        self.rpc: dict[int, pb.PlanDevice] = {}
        index = 0
        for endpoint in self.endpoints:
            for device in by_endpoint[endpoint]:
                self.rpc[index] = device
                index += 1

    def local_name(self, device: pb.PlanDevice) -> str:
        """The name the primary's llama-server knows ``device`` by (``--device``)."""
        if not device.endpoint:
            return device.device
        for index, known in self.rpc.items():
            if known is device:
                return f"RPC{index}"
        raise ValueError(f"device {device.device} at {device.endpoint} is not in the plan")

    def names(self) -> tuple[str, ...]:
        """``--device``, in the plan's order."""
        return tuple(self.local_name(d) for d in self.devices)

    def blame(self, failure: MemoryFailure) -> Blame:
        """Whose device ``failure`` happened on (this node's host when it cannot tell)."""
        match = _RPC_BUFFER.match(failure.buffer)
        if match:
            index, endpoint = int(match["index"]), match["endpoint"]
            if endpoint:
                # A buffer is named for its server's own device number: RPC<i>[host:port].
                served = [d for d in self.devices if d.endpoint == endpoint]
                device = served[index] if index < len(served) else None
            else:  # a device name: numbered over every server
                device = self.rpc.get(index)
            if device is not None:
                return Blame(device.node_id, device.device, failure.bytes)
            node = self.endpoint_nodes.get(endpoint or "")
            if node:  # a plan without devices: the worker exposes its host
                return Blame(node, HOST_DEVICE, failure.bytes)
        local = [d for d in self.devices if not d.endpoint]
        named = [d for d in local if d.device == failure.buffer]
        if named:
            return Blame("", named[0].device, failure.bytes)
        if failure.buffer:
            return Blame("", failure.buffer, failure.bytes)
        if len(self.devices) == 1:
            only = self.devices[0]
            return Blame(only.node_id if only.endpoint else "", only.device, failure.bytes)
        return Blame("", local[0].device if len(local) == 1 else HOST_DEVICE, failure.bytes)


# --- on the primary -------------------------------------------------------------------


def plan_devices(plan: pb.ExecutionPlan) -> PlanDevices:
    """The plan's devices by their names on this primary (none when the plan is invalid:
    its setup says why)."""
    endpoints = tuple(peer_endpoint(peer) for peer in plan.rpc_peers)
    nodes = {peer_endpoint(peer): peer.node_id for peer in plan.rpc_peers}
    try:
        return PlanDevices(plan.devices, endpoints, nodes)
    except ValueError:
        return PlanDevices((), endpoints, nodes)


def out_of_memory(
    exc: LlamaRuntimeError, devices: PlanDevices, server: LlamaServer | None = None
) -> tuple[Blame, str] | None:
    """Whose device ran out of memory, and llama.cpp's line saying so, when ``exc`` is an
    out-of-memory (read from the process's output: a failed start, a crash, a dead server)."""
    if isinstance(exc, RuntimeStartError | RuntimeCrashedError):
        lines = exc.last_output()
    else:
        lines = [str(exc)]
        if server is not None and not server.alive:
            lines += server.tail(400)
    failure = find_out_of_memory(lines)
    if failure is None:
        return None
    return devices.blame(failure), failure.line


def oom_message(blame: Blame, line: str, exc: LlamaRuntimeError) -> str:
    where = f"node {blame.node_id}" if blame.node_id else "this node"
    asked = f" asking for {blame.bytes} bytes" if blame.bytes else ""
    return f"device {blame.device or '?'} of {where} ran out of memory{asked}: {line} ({exc})"


def worker_out_of_memory(exc: Exception, devices: Sequence[str]) -> Blame | None:
    """An RPC worker that could not start for want of memory: which of its ``devices`` (its
    host when it exposes none or llama.cpp does not say), from its output."""
    if not isinstance(exc, RuntimeStartError | RuntimeCrashedError):
        return None
    failure = find_out_of_memory(exc.last_output())
    if failure is None:
        return None
    device = failure.buffer if failure.buffer in devices else ""
    if not device:
        device = devices[0] if len(devices) == 1 else HOST_DEVICE
    return Blame("", device, failure.bytes)
