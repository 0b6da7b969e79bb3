"""The agent's llama-server ``/health`` polls (several a second while a model loads) are
logged at DEBUG, not at INFO like httpx's other request lines (agent/runtime/llama_server.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from agent.runtime.llama_server import HEALTH_PATH, HTTPX_LOGGER, log_health_polls_at_debug


def _answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503 if request.url.path == HEALTH_PATH else 200)


@pytest.fixture
def fake_llama_server() -> Iterator[httpx.Client]:
    """A client whose requests a fake llama-server answers in memory (httpx logs them as
    for a real one)."""
    log_health_polls_at_debug()
    log_health_polls_at_debug()  # once is enough; twice changes nothing
    with httpx.Client(transport=httpx.MockTransport(_answer)) as client:
        yield client


def _httpx_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == HTTPX_LOGGER]


def test_health_polls_are_not_logged_at_info(
    fake_llama_server: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake_llama_server.get(f"http://127.0.0.1:8080{HEALTH_PATH}")
    fake_llama_server.post("http://127.0.0.1:8080/v1/chat/completions")
    lines = _httpx_lines(caplog)
    assert [level for level, _ in lines] == [logging.INFO]
    assert "/v1/chat/completions" in lines[0][1]


def test_health_polls_are_logged_at_debug(
    fake_llama_server: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fake_llama_server.get(f"http://127.0.0.1:8080{HEALTH_PATH}")
    polls = [(lvl, text) for lvl, text in _httpx_lines(caplog) if HEALTH_PATH in text]
    assert polls == [
        (
            logging.DEBUG,
            f'HTTP Request: GET http://127.0.0.1:8080{HEALTH_PATH} "HTTP/1.1 503 '
            'Service Unavailable"',
        )
    ]
    assert [r.levelname for r in caplog.records if HEALTH_PATH in r.getMessage()] == ["DEBUG"]
