"""What the agent reports about its node: hardware inventory and local GGUF models."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from agent.agent_config import AgentConfig
from agent.discovery import Inventory, discover_inventory
from agent.model_fetch import models_room
from agent.model_store import LocalModel, ModelStore
from proto import control_pb2 as pb

log = logging.getLogger(__name__)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resources:
    inventory: Inventory
    models: tuple[LocalModel, ...]

    def fingerprint(self) -> tuple[object, ...]:
        """What counts as a meaningful change: everything but free memory and free disk."""
        inv = self.inventory
        gpus = tuple(dataclasses.replace(g, memory_free_bytes=0) for g in inv.gpus)
        stable = dataclasses.replace(
            inv, disk_free_bytes=0, gpus=gpus, labels={}, models_free_bytes=None
        )
        return (stable, tuple(sorted(inv.labels.items())), self.models)

    def to_proto(self) -> pb.ResourceReport:
        return pb.ResourceReport(
            inventory=self.inventory.to_proto(), models=[m.to_proto() for m in self.models]
        )


class ResourceCollector:
    """Discovers the hardware and scans the models directory (hashes are cached, so only new
    files are hashed). A scan cancelled with its stream keeps running in its thread; two never
    run at once."""

    def __init__(self, config: AgentConfig, nvml_module: Any | None = None) -> None:
        self.config = config
        self.nvml_module = nvml_module
        self._store = ModelStore(config.resolved_models_dir, config.data_dir)
        self._lock = threading.Lock()

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
            )
            room = models_room(self.config.resolved_models_dir, self.config.models_disk_limit_bytes)
            inventory = dataclasses.replace(inventory, models_free_bytes=room)
            return Resources(inventory, tuple(self._store.scan()))


def log_resources(resources: Resources) -> None:
    inv = resources.inventory
    usable = [m.file_name for m in resources.models if m.ok]
    log.info(
        "discovered %s: %s (%d cores / %d threads), %.1f GiB RAM, %d GPU(s), "
        "%d model(s) %s, advertising %s (RPC port %d)",
        inv.hostname,
        inv.cpu_model,
        inv.cpu_cores,
        inv.cpu_threads,
        inv.ram_total_bytes / (1 << 30),
        len(inv.gpus),
        len(usable),
        usable,
        inv.advertised_address,
        inv.rpc_port,
    )
    for model in resources.models:
        if not model.ok:
            log.warning("model %s is unusable: %s", model.path, model.error)
