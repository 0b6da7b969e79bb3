"""``dacp keys create|list|show|change|revoke`` (interfaces/cli/keys_cli.py) through
``interfaces.cli.main.main``, against the admin API of an app over real Postgres and SQLite (the
CLI's HTTP calls are handed to a Litestar test client)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient

from infrastructure.settings import Settings
from infrastructure.storage import Storage
from interfaces.cli import main as cli
from interfaces.http.http_app import create_app
from tests.integration.test_admin_jobs_api import services_for

AI_KEY = "test-ai-key"


@pytest.fixture
def client(storage: Storage, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient[Any]]:
    svc = services_for(storage)
    svc.settings = Settings(admin_api_key="test-admin-key", ai_api_key=AI_KEY)
    monkeypatch.setenv("DACP_URL", "http://controller.test")
    monkeypatch.setenv("ADMIN_API_KEY", "test-admin-key")
    with TestClient(create_app(svc)) as c:

        def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
            kwargs.pop("timeout", None)
            kwargs.pop("verify", None)
            return c.request(method, url.removeprefix("http://controller.test"), **kwargs)

        monkeypatch.setattr(httpx, "request", request)
        yield c


def dacp(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["keys", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_create_prints_the_key_once(
    client: TestClient[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dacp(capsys, "create", "team-a", "--models", "m1,m2", "--rpm", "60")
    assert code == 0, err
    key = out.strip()
    assert key.startswith("sk-dacp-") and "\n" not in key
    assert "will not be shown again" in err and "team-a" in err
    assert "used the controller at http://controller.test" in err
    models = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert models.status_code == 200

    code, out, _ = dacp(capsys, "list")
    assert code == 0 and key not in out
    header, row = out.splitlines()
    assert header.split() == [
        "ID",
        "NAME",
        "OWNER",
        "MODELS",
        "LIMITS",
        "PRIORITY",
        "EXPIRES",
        "STATE",
    ]
    assert row.split()[1:] == ["team-a", "-", "m1,m2", "rpm=60", "interactive", "never", "active"]


def test_create_as_json_with_every_term(
    client: TestClient[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dacp(
        capsys,
        "create",
        "batch",
        "--owner",
        "ml",
        "--tpm",
        "1000",
        "--concurrent",
        "2",
        "--monthly-tokens",
        "5000000",
        "--priority",
        "batch",
        "--expires-at",
        "2099-01-01T00:00:00Z",
        "--json",
    )
    assert code == 0, err
    created = json.loads(out)
    assert created["key"].startswith("sk-dacp-")
    assert created["limits"] == {
        "requests_per_minute": None,
        "tokens_per_minute": 1000,
        "concurrent_requests": 2,
        "monthly_tokens": 5000000,
    }
    assert (created["owner"], created["priority"], created["models"]) == ("ml", "batch", None)

    code, out, _ = dacp(capsys, "show", "batch", "--json")
    shown = json.loads(out)
    assert code == 0 and "key" not in shown and shown["id"] == created["id"]


def test_show_change_and_revoke_by_name_or_id(
    client: TestClient[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = dacp(capsys, "create", "a", "--rpm", "10", "--tpm", "100", "--json")
    created = json.loads(out)
    code, out, err = dacp(capsys, "change", "a", "--rpm", "none", "--concurrent", "3")
    assert code == 0, err
    assert "limits: tpm=100 concurrent=3" in out.splitlines()
    code, out, _ = dacp(capsys, "change", created["id"], "--models", "m1", "--name", "b")
    assert code == 0 and "models: m1" in out and "name: b" in out
    code, out, _ = dacp(capsys, "change", "b", "--models", "all", "--expires-at", "never")
    assert code == 0 and "models: all" in out and "expires: never" in out

    code, out, _ = dacp(capsys, "show", created["id"])
    assert code == 0 and f"id: {created['id']}" in out and "state: active" in out

    code, out, _ = dacp(capsys, "revoke", "b", "--reason", "leaked")
    assert code == 0 and out.startswith(f"revoked API key b ({created['id']})")
    key = {"Authorization": f"Bearer {created['key']}"}
    assert client.get("/v1/models", headers=key).status_code == 401
    code, out, _ = dacp(capsys, "show", "b")
    assert "state: revoked" in out and "leaked" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["show", "nobody"], "no API key named nobody"),
        (["revoke", "nobody"], "no API key named nobody"),
        (["change", "taken"], "nothing to change"),
        (["create", "x", "--expires-at", "tomorrow"], "refused (400)"),
        (["create", " "], "refused (400)"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    client: TestClient[Any], capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    dacp(capsys, "create", "taken")
    code, out, err = dacp(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("dacp: ") and says in err and len(err.strip().splitlines()) == 1


def test_revoking_twice_is_refused(
    client: TestClient[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    dacp(capsys, "create", "taken")
    assert dacp(capsys, "revoke", "taken")[0] == 0
    code, out, err = dacp(capsys, "revoke", "taken")
    assert (code, out) == (2, "")
    assert err.startswith("dacp: refused (409)") and len(err.strip().splitlines()) == 1


def test_a_bad_limit_is_refused_by_the_parser(
    client: TestClient[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["keys", "create", "x", "--rpm", "0"])
    assert exited.value.code == 2
    assert "a limit is positive" in capsys.readouterr().err
