"""Enrollments for tests that drive the controller application: what a node supplies when it
enrolls, and a node enrolled and READY."""

from __future__ import annotations

import dataclasses
from typing import Any

from application.commands import Enrollment
from application.controller import Controller


def enrollment(name: str = "n1", *, ram: int = 8 << 30, **fields: Any) -> Enrollment:
    """``name``'s enrollment from 127.0.0.1 with ``ram`` bytes, all free, one slot and token
    ``tok-{name}``; ``fields`` replace any of these."""
    base = Enrollment(
        name=name,
        inventory={"ram_total_bytes": ram, "ram_free_bytes": ram, "gpus": []},
        agent_version="test",
        address="127.0.0.1",
        rpc_port=50052,
        labels={},
        credential_sha256="c" * 64,
        token_id=f"tok-{name}",
        single_use_token=False,
    )
    return dataclasses.replace(base, **fields)


def ready_node(app: Controller, name: str = "n1", *, ram: int = 8 << 30, **fields: Any) -> str:
    """Enrolls :func:`enrollment` (``fields`` as there) and marks the node READY; its id."""
    result = app.enroll(enrollment(name, ram=ram, **fields))
    assert result.aggregate_id is not None
    node_id = str(result.aggregate_id)
    app.mark_ready(node_id)
    return node_id
