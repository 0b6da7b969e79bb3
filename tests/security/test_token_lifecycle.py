"""Enrollment tokens can be listed and revoked (admin API and `dacp token`), and a revoked,
expired or reused token enrolls nobody; multi-use is an explicit choice, recorded."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import orjson
import pytest

from domain.times import iso_time
from interfaces.controller_main import RunningController
from tests.integration.control_client import control_target, enroll
from tests.security.conftest import dacp

ADMIN = {"Authorization": "Bearer test-admin-key"}
REPO = Path(__file__).resolve().parents[2]


async def _refused(ctl: RunningController, token: str, name: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await enroll(control_target(ctl), token, name)
    return refused.value


async def test_tokens_are_listed_and_a_revoked_one_enrolls_nobody(ctl: RunningController) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as client:
        once = (await client.post("/api/admin/enrollment-tokens", headers=ADMIN, json={})).json()
        many = (
            await client.post(
                "/api/admin/enrollment-tokens", headers=ADMIN, json={"single_use": False}
            )
        ).json()
        listed = (await client.get("/api/admin/enrollment-tokens", headers=ADMIN)).json()["data"]
        by_id = {row["token_id"]: row for row in listed}
        assert by_id[once["token_id"]]["single_use"] is True
        assert by_id[many["token_id"]]["single_use"] is False  # the explicit choice, recorded
        assert "token" not in by_id[once["token_id"]]  # the token itself is not kept

        revoked = await client.post(
            f"/api/admin/enrollment-tokens/{many['token_id']}/revoke", headers=ADMIN
        )
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["revoked"] is True and revoked.json()["revoked_by"] == "admin-api"
        again = await client.post(
            f"/api/admin/enrollment-tokens/{many['token_id']}/revoke", headers=ADMIN
        )
        assert again.status_code == 409
        unknown = await client.post("/api/admin/enrollment-tokens/abc123/revoke", headers=ADMIN)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "token_not_found"

    refused = await _refused(ctl, many["token"], "late")
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED and "revoked" in str(
        refused.details()
    )
    # The single-use one works once, then never again.
    assert (await enroll(control_target(ctl), once["token"], "first")).node_id
    assert (await _refused(ctl, once["token"], "second")).code() == grpc.StatusCode.ALREADY_EXISTS


async def test_dacp_token_create_list_and_revoke(ctl: RunningController, pg_schema: str) -> None:
    env = {
        "NODE_ENROLLMENT_SECRET": "test-enrollment-secret",
        "DACP_VAR_DIR": str(ctl.services.settings.var_dir),  # the controller's CA
    }
    created = await dacp(pg_schema, "token", "create", "--store", "--json", **env)
    assert created.returncode == 0, created.stderr
    minted = orjson.loads(created.stdout)
    assert minted["single_use"] is True and 3590 < minted["expires_at"] - time.time() <= 3600
    ctl.services.follower.wait(ctl.services.app.position(), timeout=5)
    listing = await dacp(pg_schema, "token", "list")
    assert listing.returncode == 0, listing.stderr
    [line] = [ln for ln in listing.stdout.splitlines() if ln.startswith(minted["token_id"])]
    assert line.split()[-1] == "valid" and " cli " in line
    assert f" {iso_time(minted['expires_at'])} " in line  # a time people read, not unix seconds
    revoked = await dacp(pg_schema, "token", "revoke", "--store", minted["token_id"])
    assert revoked.returncode == 0, revoked.stderr
    refused = await _refused(ctl, minted["token"], "too-late")
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    missing = await dacp(pg_schema, "token", "revoke", "--store", "0123abcd")
    assert missing.returncode == 2 and "unknown enrollment token" in missing.stderr


async def test_a_token_is_never_minted_for_a_name_enroll_would_refuse(
    ctl: RunningController, pg_schema: str
) -> None:
    """A name that breaks the node-name rule (a NUL, a space, too long) gets no token: Enroll
    would refuse every agent that used it, so minting says so at once."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as client:
        for name in ("gpu\x00box", "gpu box", "-lead", "x" * 65):
            refused = await client.post(
                "/api/admin/enrollment-tokens", headers=ADMIN, json={"node_name": name}
            )
            assert refused.status_code == 400, (name, refused.text)
            error = refused.json()["error"]
            assert error["param"] == "node_name", error
            # Too long is the schema's to say (maxLength); a character, the node-name rule's.
            code = "invalid_request" if len(name) > 64 else "invalid_node_name"
            assert error["code"] == code, error
        fine = await client.post(
            "/api/admin/enrollment-tokens", headers=ADMIN, json={"node_name": "gpu-box.1"}
        )
        assert fine.status_code == 201, fine.text
    env = {
        "NODE_ENROLLMENT_SECRET": "test-enrollment-secret",
        "DACP_VAR_DIR": str(ctl.services.settings.var_dir),
    }
    cli = await dacp(pg_schema, "token", "create", "--store", "--node-name", "gpu box", **env)
    assert cli.returncode == 2 and cli.stdout == ""
    assert len(cli.stderr.strip().splitlines()) == 1 and "node_name" in cli.stderr
