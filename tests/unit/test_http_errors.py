"""How store errors become HTTP answers (``interfaces.http.http_errors``)."""

from __future__ import annotations

from typing import Any

import pytest
from eventsourcing.persistence import DataError, IntegrityError, OperationalError
from litestar import Litestar, get
from litestar.testing import TestClient

from application.store_guard import StoreUnavailable
from interfaces.http.http_errors import EXCEPTION_HANDLERS


def answer_to(error: Exception) -> Any:
    @get("/boom", sync_to_thread=False)
    def boom() -> None:
        raise error

    app = Litestar([boom], exception_handlers=EXCEPTION_HANDLERS)
    with TestClient(app) as client:
        return client.get("/boom")


@pytest.mark.parametrize(
    "error",
    [
        OperationalError("the server closed the connection"),
        IntegrityError("a version conflict outlived its retries"),
        StoreUnavailable("the event store is unreachable"),
        TimeoutError("the views did not catch up"),
    ],
)
def test_a_busy_or_unreachable_store_is_503_with_retry_after(error: Exception) -> None:
    response = answer_to(error)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "store_unavailable"


def test_a_value_the_store_refuses_is_our_bug_not_a_busy_store() -> None:
    """A NUL byte in a Postgres text (the fuzzer's find) was "503 busy, retry shortly",
    with the database's message: retrying could never help. Input is checked before it
    reaches the store now; what slips through is a logged 500 that says nothing more."""
    response = answer_to(DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"))
    assert response.status_code == 500
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "server_error" and "NUL" not in error["message"]
