"""What the budget tests need around a controller process started by ``controller_in``: the
process itself (its memory and threads, read with psutil and /proc), its control channel, a
token, and a fake agent that answers chat completions through the OpenAI API."""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from application.enrollment import enrollment_key, mint_enrollment_token
from common.contract import CONTROLLER_TLS_NAME
from infrastructure.tls import fingerprint_of
from tests.integration.control_client import ControlTarget
from tests.integration.fake_agent import FakeAgent, register_model_m
from tests.security.conftest import AI_KEY, ENROLLMENT_SECRET
from tests.security.netns import Namespace

ADMIN = {"Authorization": "Bearer test-admin-key"}
AI = {"Authorization": f"Bearer {AI_KEY}"}
MODEL_SHA = "cd" * 32
MIB = 1 << 20


def controller_process(env: dict[str, str]) -> psutil.Process:
    """The controller ``controller_in`` started (this process's child serving ``env``'s port)."""
    for child in psutil.Process().children(recursive=True):
        try:
            if (
                "interfaces.cli.main" in child.cmdline()
                and child.environ().get("PORT") == env["PORT"]
            ):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no controller process serves port {env['PORT']}")


def _status(proc: psutil.Process, field: str) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise AssertionError(f"{field} missing from /proc/{proc.pid}/status")


def rss(proc: psutil.Process) -> int:
    return _status(proc, "VmRSS")


def peak_rss(proc: psutil.Process) -> int:
    """The most resident memory the process ever had (VmHWM)."""
    return _status(proc, "VmHWM")


def controller_log(env: dict[str, str]) -> Path:
    return Path(env["DACP_VAR_DIR"]).parent / f"controller-{env['PORT']}.log"


def target(env: dict[str, str]) -> ControlTarget:
    return ControlTarget(env["GRPC"], Path(env["CA"]).read_bytes(), CONTROLLER_TLS_NAME)


def signed_token(
    ca_fingerprint: str | None, *, ttl_seconds: int = 600, single_use: bool = False
) -> str:
    """An enrollment token signed with the test controllers' secret, for any node name."""
    return mint_enrollment_token(
        enrollment_key(ENROLLMENT_SECRET),
        ttl_seconds=ttl_seconds,
        single_use=single_use,
        node_name=None,
        now=time.time(),
        ca_fingerprint=ca_fingerprint,
    ).token


def token(env: dict[str, str], ttl_seconds: int = 600) -> str:
    """A reusable token that pins the CA of the controller ``env`` describes."""
    return signed_token(fingerprint_of(Path(env["CA"]).read_bytes()), ttl_seconds=ttl_seconds)


def https(env: dict[str, str]) -> httpx.AsyncClient:
    trust = ssl.create_default_context(cafile=env["CA"])
    return httpx.AsyncClient(base_url=env["URL"], verify=trust, timeout=30)


async def serving_agent(env: dict[str, str], namespace: Namespace) -> FakeAgent:
    """An enrolled fake agent holding the model ``m``, which is registered; once this returns
    the model can be asked for."""
    agent = await FakeAgent(
        target(env),
        token(env),
        "healthy",
        holds=MODEL_SHA,
        memory=4 << 30,
        address=namespace.outside,
    ).start()
    async with https(env) as client:
        await register_model_m(client, MODEL_SHA)
    return agent


async def answered(client: httpx.AsyncClient) -> str:
    """One chat completion for ``m``; its answer."""
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = await client.post("/v1/chat/completions", headers=AI, json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in a Prometheus exposition (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{wanted}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
