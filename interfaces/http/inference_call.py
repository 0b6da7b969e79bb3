"""What a generating handler (chat, completion, embeddings) works with, provided as one
dependency: declare ``call: Provided[InferenceCall]``.

Litestar resolves a handler's independent dependencies side by side, each in a task of an anyio
task group; the three these handlers took (services, job manager, Grant) cost a warm request
about 0.3 ms before its handler ran, on the first token's path. One dependency is resolved in
the request's own task. The other routes keep their dependencies one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from domain.api_keys import Grant

if TYPE_CHECKING:  # interfaces.services imports the routes' parts
    from application.job_manager import JobManager
    from interfaces.services import Services


@dataclass(frozen=True, slots=True)
class InferenceCall:
    #: The controller's services.
    svc: Services
    #: The job manager (None in an app built without one: the request answers 503).
    jobs: JobManager | None
    #: The request's key, as the inference guard resolved it.
    grant: Grant
