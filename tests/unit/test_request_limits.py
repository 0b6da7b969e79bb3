"""The request's limits: max_tokens capped by the context, and a failed job's HTTP error (a
prompt longer than the context is the client's 400, not a 502)."""

from __future__ import annotations

from agent.runtime.llama_server import _exceeds_context, _refusal
from agent.runtime.runtime_errors import ContextTooLong, GenerationError, RequestRejected
from application.commands import JobParams
from application.deadlines import STREAM_IDLE_TIMEOUT
from application.job_manager import capped
from application.store_guard import STORE_UNAVAILABLE
from common.contract import REQUEST_REJECTED
from interfaces.http.openai.openai_api import job_error


def test_max_tokens_is_capped_by_the_context() -> None:
    assert capped(JobParams(max_tokens=100), 2048).max_tokens == 100
    assert capped(JobParams(max_tokens=99_999), 2048).max_tokens == 2048
    assert capped(JobParams(temperature=0.5), 2048) == JobParams(temperature=0.5, max_tokens=2048)


def test_a_prompt_over_the_context_is_the_requests_fault() -> None:
    error = job_error("request (4476 tokens) exceeds the context (2048)", "context_length_exceeded")
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert job_error("stalled", STREAM_IDLE_TIMEOUT).status == 504
    assert job_error("crashed", "RUNTIME_CRASHED").status == 502
    refused = job_error("cannot resolve $ref", REQUEST_REJECTED)
    assert (refused.status, refused.code) == (400, REQUEST_REJECTED)
    outage = job_error("recording the job failed: unreachable", STORE_UNAVAILABLE)
    assert (outage.status, outage.code) == (503, STORE_UNAVAILABLE)
    assert outage.headers == {"Retry-After": "2"}


def test_llama_servers_400_is_the_requests_fault_and_its_5xx_ours() -> None:
    context = '{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}'
    assert _refusal(400, context) is ContextTooLong
    assert _refusal(400, '{"error":{"message":"bad schema"}}') is RequestRejected
    assert _refusal(500, "oops") is GenerationError


def test_llama_servers_context_refusal_is_recognised() -> None:
    body = (
        '{"error":{"code":400,"message":"request (4476 tokens) exceeds the available context '
        'size (2048 tokens)","type":"exceed_context_size_error","n_prompt_tokens":4476,'
        '"n_ctx":2048}}'
    )
    assert _exceeds_context(body)
    assert not _exceeds_context('{"error":{"code":400,"message":"bad","type":"invalid_request"}}')
    assert not _exceeds_context("not json")
