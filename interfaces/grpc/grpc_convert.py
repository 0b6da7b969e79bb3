"""Conversions between control-channel protobuf messages and plain JSON-safe dicts, and the
bounds on what a node's message may make the controller keep (:func:`clamp_strings`)."""

from __future__ import annotations

import re
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from common.contract import DEVICE_CPU, DEVICE_GPU, MEMORY_LIMIT_LABEL
from domain.bounded_text import ID_MAX, TEXT_MAX, bounded
from wire import control_pb2 as pb

#: Fields whose text is content relayed to a client (a token's text, an embedding), or parsed
#: and never kept (a signing request): bounded by the message size limit alone.
CONTENT_FIELDS = frozenset({"text", "extra_json", "output_json", "csr_pem"})
#: Fields of free text (an error, a fault, a reason): TEXT_MAX characters, newlines kept.
#: Every other string a node sends is an identifier or a short name: ID_MAX characters.
TEXT_FIELDS = frozenset({"error", "message", "reason"})
#: The most GPUs, devices, job ids in a heartbeat, models in a report and labels kept of a node.
MAX_GPUS = 64
MAX_DEVICES = 64
#: The device kinds a node may report (any other is left out).
DEVICE_KINDS = frozenset({DEVICE_GPU, DEVICE_CPU})
MAX_HEARTBEAT_JOBS = 1024
MAX_REPORTED_MODELS = 1024
MAX_LABELS = 64


def clamp_strings(message: Message) -> None:
    """Cuts, in place, every string of a node's message (all its depth, map keys and values
    too) to what the controller may record or log: TEXT_FIELDS to TEXT_MAX characters, the
    rest to ID_MAX, non-printable characters escaped (:func:`domain.bounded_text.bounded`).
    CONTENT_FIELDS are left alone."""
    for field, value in message.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            entry = field.message_type
            if entry is not None and entry.GetOptions().map_entry:
                _clamp_map(value)
            elif field.is_repeated:
                for item in value:
                    clamp_strings(item)
            else:
                clamp_strings(value)
        elif field.type == FieldDescriptor.TYPE_STRING and field.name not in CONTENT_FIELDS:
            text = field.name in TEXT_FIELDS
            limit = TEXT_MAX if text else ID_MAX
            if field.is_repeated:
                if any(not _fits(v, limit, text) for v in value):
                    kept = [bounded(v, limit, keep_newlines=text) for v in value]
                    del value[:]
                    value.extend(kept)
            elif not _fits(value, limit, text):
                setattr(message, field.name, bounded(value, limit, keep_newlines=text))


def _fits(value: str, limit: int, text: bool) -> bool:
    return len(value) <= limit and bounded(value, limit, keep_newlines=text) == value


def _clamp_map(entries: Any) -> None:
    """A map<string, string> with its keys and values bounded."""
    if all(_fits(k, ID_MAX, False) and _fits(v, ID_MAX, False) for k, v in entries.items()):
        return
    kept = {bounded(k, ID_MAX): bounded(v, ID_MAX) for k, v in entries.items()}
    entries.clear()
    entries.update(kept)


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
            for g in inv.gpus[:MAX_GPUS]
        ],
        "devices": [
            {
                "name": d.name,
                "description": d.description,
                "kind": d.kind,
                "memory_total_bytes": d.memory_total_bytes,
                "memory_free_bytes": d.memory_free_bytes,
                "uuid": d.uuid,
            }
            for d in inv.devices[:MAX_DEVICES]
            if d.kind in DEVICE_KINDS and d.name
        ],
        "llama_version": inv.llama_version,
        "rpc_protocol": inv.rpc_protocol,
        "llama_backend": inv.llama_backend,
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
    digits, or a file name that is a path; more than MAX_REPORTED_MODELS entries."""
    if len(models) > MAX_REPORTED_MODELS:
        raise ValueError(
            f"{len(models)} models, more than the {MAX_REPORTED_MODELS} a report may list"
        )
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
            for g in hb.gpus[:MAX_GPUS]
        ],
        "active_job_ids": [bounded(j, ID_MAX) for j in hb.active_job_ids[:MAX_HEARTBEAT_JOBS]],
        "devices": [
            {"name": bounded(d.name, ID_MAX), "memory_free_bytes": d.memory_free_bytes}
            for d in hb.devices[:MAX_DEVICES]
        ],
    }
