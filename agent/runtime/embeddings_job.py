"""An embeddings job on the primary: ``/v1/embeddings`` of the local llama-server, answered by
one ``JobResult`` carrying the vectors (``output_json``) and the prompt tokens; no tokens
stream.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import logging
import time

import httpx
import orjson

from agent.control.control_handler import job_failure
from agent.runtime.job_messages import failure_of
from agent.runtime.llama_server import EmbeddingsRequest, LlamaServer
from agent.runtime.runtime_errors import (
    LlamaRuntimeError,
)
from wire import control_pb2 as pb

log = logging.getLogger(__name__)


async def embeddings_result(
    job_id: str, server: LlamaServer, request: EmbeddingsRequest, client: httpx.AsyncClient
) -> pb.AgentMessage:
    """The job's ``JobResult``: the vectors, or why there are none."""
    started = time.monotonic()
    try:
        embeddings = await server.embed(request, client=client)
    except LlamaRuntimeError as exc:
        failure = failure_of(exc)
    else:
        elapsed_ms = (time.monotonic() - started) * 1000.0
        log.info(
            "job %s done: %d embeddings of %d prompt tokens in %.0f ms",
            job_id,
            len(embeddings.data),
            embeddings.prompt_tokens,
            elapsed_ms,
        )
        return pb.AgentMessage(
            job_result=pb.JobResult(
                job_id=job_id,
                ok=True,
                finish_reason="stop",
                prompt_tokens=embeddings.prompt_tokens,
                time_to_first_token_ms=elapsed_ms,
                output_json=orjson.dumps(embeddings.data).decode(),
            )
        )
    log.warning("job %s: embeddings failed (%s): %s", job_id, *failure)
    return job_failure(job_id, "execution", *failure)
