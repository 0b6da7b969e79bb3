"""Conversions between control-channel protobuf messages and plain JSON-safe dicts."""

from __future__ import annotations

import re
from typing import Any

from proto import MEMORY_LIMIT_LABEL
from proto import control_pb2 as pb


def _memory_limit(inv: pb.Inventory) -> int:
    """The memory the agent offers to the scheduler (0: no limit), from its reserved label."""
    try:
        return max(0, int(inv.labels.get(MEMORY_LIMIT_LABEL, "0")))
    except ValueError:
        return 0


def inventory_to_dict(inv: pb.Inventory) -> dict[str, Any]:
    return {
        "memory_limit_bytes": _memory_limit(inv),
        "hostname": inv.hostname,
        "os": inv.os,
        "arch": inv.arch,
        "cpu_model": inv.cpu_model,
        "cpu_cores": inv.cpu_cores,
        "cpu_threads": inv.cpu_threads,
        "ram_total_bytes": inv.ram_total_bytes,
        "disk_total_bytes": inv.disk_total_bytes,
        "disk_free_bytes": inv.disk_free_bytes,
        "models_free_bytes": (inv.models_free_bytes if inv.HasField("models_free_bytes") else None),
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "memory_total_bytes": g.memory_total_bytes,
                "memory_free_bytes": g.memory_free_bytes,
                "driver_version": g.driver_version,
            }
            for g in inv.gpus
        ],
    }


_SHA256 = re.compile(r"[0-9a-f]{64}")


def resources_from_report(inv: pb.Inventory, ram_free_bytes: int | None) -> dict[str, Any]:
    """The resources recorded for a node: its inventory plus free RAM when known."""
    resources = inventory_to_dict(inv)
    resources["ram_free_bytes"] = (
        ram_free_bytes if ram_free_bytes is not None else inv.ram_total_bytes
    )
    return resources


def local_models_to_list(models: Any) -> list[dict[str, Any]]:
    """Readable GGUF files an agent holds (entries with an error are left out). Raises
    ValueError for an entry no agent would send: a sha256 that is not 64 lowercase hex
    digits, or a file name that is a path."""
    for m in models:
        if m.error or not m.sha256:
            continue
        if not _SHA256.fullmatch(m.sha256):
            raise ValueError(f"model {m.file_name!r}: sha256 is not 64 lowercase hex digits")
        if (
            not m.file_name
            or "/" in m.file_name
            or "\\" in m.file_name
            or m.file_name in (".", "..")
        ):
            raise ValueError(f"model file name {m.file_name!r} is not a plain file name")
    return sorted(
        (
            {
                "file_name": m.file_name,
                "size_bytes": m.size_bytes,
                "sha256": m.sha256,
                "parameters": m.parameters,
                "layers": m.layers,
                "context_length": m.context_length,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "architecture": m.architecture,
            }
            for m in models
            if not m.error and m.sha256
        ),
        key=lambda m: (m["file_name"], m["sha256"]),
    )


def heartbeat_to_dict(hb: pb.Heartbeat) -> dict[str, Any]:
    return {
        "sent_at_unix_ms": hb.sent_at_unix_ms,
        "cpu_percent": round(hb.cpu_percent, 1),
        "ram_free_bytes": hb.ram_free_bytes,
        "gpus": [
            {
                "index": g.index,
                "memory_free_bytes": g.memory_free_bytes,
                "memory_used_bytes": g.memory_used_bytes,
                "temperature_c": g.temperature_c if g.HasField("temperature_c") else None,
            }
            for g in hb.gpus
        ],
        "active_job_ids": list(hb.active_job_ids),
    }
