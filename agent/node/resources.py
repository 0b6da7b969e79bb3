"""What the agent reports about its node: hardware inventory (with the compute devices its
llama.cpp build sees), local GGUF models, and the heartbeat's telemetry."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from agent.agent_config import AgentConfig
from agent.handler_factory import RuntimeUnavailable, resolve_binaries
from agent.models.model_fetch import models_room
from agent.models.model_store import LocalModel, ModelStore
from agent.node.discovery import Inventory, Telemetry, discover_inventory, sample_telemetry
from agent.node.node_devices import DeviceInfo
from agent.runtime.llama_binaries import RuntimeBinaries
from agent.runtime.llama_devices import LlamaProbe, LlamaRuntime
from wire import control_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resources:
    inventory: Inventory
    models: tuple[LocalModel, ...]

    def fingerprint(self) -> tuple[object, ...]:
        """What counts as a meaningful change: everything but free memory and free disk."""
        inv = self.inventory
        gpus = tuple(dataclasses.replace(g, memory_free_bytes=0) for g in inv.gpus)
        devices = tuple(dataclasses.replace(d, memory_free_bytes=0) for d in inv.devices)
        stable = dataclasses.replace(
            inv, disk_free_bytes=0, gpus=gpus, devices=devices, labels={}, models_free_bytes=None
        )
        return (stable, tuple(sorted(inv.labels.items())), self.models)

    def to_proto(self) -> pb.ResourceReport:
        return pb.ResourceReport(
            inventory=self.inventory.to_proto(), models=[m.to_proto() for m in self.models]
        )


class ResourceCollector:
    """Discovers the hardware and scans the models directory (hashes are cached, so only new
    files are hashed). A scan cancelled with its stream keeps running in its thread; two never
    run at once. The llama.cpp build is asked for its devices once (:class:`LlamaProbe`);
    heartbeats read the devices of the last inventory (:meth:`telemetry`)."""

    def __init__(
        self,
        config: AgentConfig,
        nvml_module: Any | None = None,
        probe: LlamaProbe | None = None,
    ) -> None:
        self.config = config
        self.nvml_module = nvml_module
        self._store = ModelStore(config.resolved_models_dir, config.data_dir)
        self._lock = threading.Lock()
        self._probe = probe if probe is not None else LlamaProbe()
        self._unavailable_logged = False
        self._binaries: RuntimeBinaries | None = None  # resolved once, as the handler's
        #: The devices of the last inventory (replaced whole, read by heartbeats).
        self._devices: tuple[DeviceInfo, ...] = ()

    async def collect(self) -> Resources:
        return await asyncio.to_thread(self.collect_sync)

    def collect_sync(self) -> Resources:
        with self._lock:
            inventory = discover_inventory(
                self.config.data_dir,
                self.config.resolved_models_dir,
                self.config.advertise_address,
                self.config.rpc_port,
                self.config.inventory_labels(),
                nvml_module=self.nvml_module,
                llama=self._llama(),
            )
            room = models_room(self.config.resolved_models_dir, self.config.models_disk_limit_bytes)
            inventory = dataclasses.replace(inventory, models_free_bytes=room)
            self._devices = inventory.devices
            return Resources(inventory, tuple(self._store.scan()))

    def _llama(self) -> LlamaRuntime | None:
        """What the llama.cpp build says of itself; None without a runtime (``--no-runtime``,
        or binaries that are not there: logged once)."""
        if not self.config.llama_runtime:
            return None
        if self._binaries is None:
            try:
                self._binaries = resolve_binaries(self.config)
            except RuntimeUnavailable as exc:
                if not self._unavailable_logged:
                    log.warning("no llama.cpp devices to report: %s", exc)
                    self._unavailable_logged = True
                return None
        return self._probe.runtime(self._binaries)

    def telemetry(self) -> Telemetry:
        """A heartbeat sample with the free memory of the last inventory's devices (before
        the first inventory: none). Starts no process."""
        return sample_telemetry(nvml_module=self.nvml_module, devices=self._devices)


def log_resources(resources: Resources) -> None:
    inv = resources.inventory
    usable = [m.file_name for m in resources.models if m.ok]
    log.info(
        "discovered %s: %s (%d cores / %d threads), %.1f GiB RAM, %d GPU(s), devices %s, "
        "%d model(s) %s, advertising %s (RPC port %d)",
        inv.hostname,
        inv.cpu_model,
        inv.cpu_cores,
        inv.cpu_threads,
        inv.ram_total_bytes / (1 << 30),
        len(inv.gpus),
        [d.name for d in inv.devices],
        len(usable),
        usable,
        inv.advertised_address,
        inv.rpc_port,
    )
    for model in resources.models:
        if not model.ok:
            log.warning("model %s is unusable: %s", model.path, model.error)
