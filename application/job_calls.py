"""The small calls every part of the job manager makes on the controller and the agents: a
store command in a thread, a command that must not stop its path, a node's label for people,
and telling a job's primary to stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from application.controller import Controller
from application.errors import NotFound
from application.job_run import JobRun
from application.ports import AgentGateway
from domain.errors import DomainError

log = logging.getLogger(__name__)

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs a (blocking) store command off the event loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Runs a command that is no job's ending on a path that must go on whatever happens
    to the command (a security violation, an RPC worker's start or stop): a refusal or a
    store error is logged. Endings go through :meth:`EndingRecorder.record`, which retries."""
    try:
        await in_thread(fn, *args)
    except (DomainError, NotFound) as e:
        log.info("%s skipped: %s", getattr(fn, "__name__", fn), e)
    except Exception:
        log.exception("%s failed", getattr(fn, "__name__", fn))


def node_label(app: Controller, node_id: str) -> str:
    """``name (id prefix)`` for messages people read; the id alone if unknown."""
    try:
        return f"{app.get_node(node_id).name} ({node_id[:8]})"
    except (NotFound, ValueError):
        return node_id


def cancel_on_primary(gateway: AgentGateway, run: JobRun, reason: str) -> None:
    """Tells the run's primary to stop generating (it keeps its runtime otherwise busy)."""
    if run.primary and run.setup_future is not None:
        gateway.cancel_job(run.primary, run.job_id, reason)
