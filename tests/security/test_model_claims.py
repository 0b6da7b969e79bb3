"""A node's model claims are checked, not believed (issue 21, finding 3).

A real controller (the tests' Postgres, TLS on), real agents holding a real GGUF file, and
claiming nodes that speak the real control protocol over TLS, as ``bench.synthetic_agents``
does: each enrolls, reports a model file with whatever size and shape it likes and 64 GiB of
free memory, heartbeats, and answers every plan with ``" tok"`` words. A model's size and
shape come from its registration (the controller's model store, or the first node that
proved it holds the file); a claim that disagrees is refused and recorded
(``MODEL_CLAIM_REFUSED``); a node is a model's primary only once it answered a challenge of
byte ranges the controller picked at random (``MODEL_PROVEN``); revoked and offline nodes
count for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest

from agent.agent_config import AgentConfig
from agent.control.control_client import AgentSession, AgentState
from bench.synthetic_agents import wire_inventory
from common.contract import MEMORY_LIMIT_LABEL, SLOTS_LABEL, TRANSFER_PORT_LABEL
from common.gguf_metadata import read_gguf_metadata
from domain.catalog import code_of
from domain.model import model_id
from domain.placement import ExecutionPlan, ModelNeeds, required_bytes
from infrastructure.model_store import ControllerModelStore
from interfaces.controller_main import RunningController
from tests.faults.streams import SlowWords, stream_completion
from tests.faults.waiting import until
from tests.integration.control_client import RawSession, control_target
from tests.unit.test_agent_model_store import write_tiny_gguf
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": "Bearer test-admin-key"}
GIB = 1 << 30
FAKE_MEMORY = 64 * GIB
HONEST_WORDS = " w0 w1 w2"


# ------------------------------------------------------------------------------- the file


def tiny_model(directory: Path) -> tuple[Path, str, dict[str, Any]]:
    """A small real GGUF file as ``m.gguf``: its path, sha256 and shape (as a store reads it)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "m.gguf"
    write_tiny_gguf(path)
    meta = read_gguf_metadata(path)
    shape = {
        "size_bytes": path.stat().st_size,
        "layers": meta.layers,
        "context_length": meta.context_length,
        "kv_bytes_per_token": meta.kv_bytes_per_token,
        "architecture": meta.architecture,
    }
    return path, hashlib.sha256(path.read_bytes()).hexdigest(), shape


def stored_model(ctl: RunningController, directory: Path) -> tuple[Path, str, dict[str, Any]]:
    """A :func:`tiny_model` in ``directory``, then ``dacp models add``: the file in the
    controller's store, model ``m`` registered to it. Its path, sha256 and shape."""
    path, sha256, shape = tiny_model(directory)
    stored = ControllerModelStore(ctl.services.settings.model_store_dir).add(path)
    assert stored.sha256 == sha256
    ctl.services.app.store_model("m", sha256, "m.gguf", shape, 2048)
    return path, sha256, shape


# ------------------------------------------------------------------------------ the nodes


def honest_agent(
    ctl: RunningController, root: Path, name: str, models: Path | None
) -> tuple[AgentSession, SlowWords]:
    """A real agent session (its handler streams HONEST_WORDS instead of running llama.cpp)
    with ``models`` as its models directory (None: an empty one), 2 GiB offered."""
    token = ctl.services.enrollment.mint(
        ttl_seconds=60, single_use=True, node_name=None, now=time.time()
    ).token
    handler = SlowWords(words=3, delay=0.0)
    config = AgentConfig(
        data_dir=root / name,
        models_dir=models if models is not None else root / name / "models",
        node_name=name,
        controller_url=f"127.0.0.1:{ctl.grpc_port}",
        enrollment_token=token,
        heartbeat_interval=0.2,
        backoff_initial=0.05,
        backoff_max=0.5,
        memory_limit_bytes=2 * GIB,
        models_disk_limit_bytes=GIB,
    )
    return AgentSession(config, handler), handler


class ClaimingNode:
    """An enrolled node that claims a model file: 64 GiB free, whatever size and shape it
    is given. It proves possession with the bytes of ``content`` (None: it ignores the
    controller's challenges), and answers every plan with ``" tok"`` words."""

    def __init__(
        self,
        ctl: RunningController,
        name: str,
        sha256: str,
        claim: dict[str, Any],
        *,
        content: bytes | None = None,
        serves_files: bool = False,
    ) -> None:
        self.ctl, self.name, self.sha256, self.claim = ctl, name, sha256, claim
        self.content = content
        self.serves_files = serves_files
        self.node_id = ""
        self.plans: list[str] = []
        self.challenges = 0
        self.session: RawSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _inventory(self) -> pb.Inventory:
        labels = {MEMORY_LIMIT_LABEL: str(FAKE_MEMORY), SLOTS_LABEL: "4"}
        if self.serves_files:
            labels[TRANSFER_PORT_LABEL] = "50053"
        return wire_inventory(
            hostname=self.name,
            cpu_model="claimed",
            ram=FAKE_MEMORY,
            cores=64,
            threads=128,
            disk_total=4 << 40,
            disk_free=2 << 40,
            labels=labels,
        )

    async def start(self) -> ClaimingNode:
        target = control_target(self.ctl)
        token = self.ctl.services.enrollment.mint(
            ttl_seconds=60, single_use=True, node_name=None, now=time.time()
        ).token
        async with target.channel() as channel:
            stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            enrolled = await stub.Enroll(
                pb.EnrollRequest(
                    enrollment_token=token,
                    node_name=self.name,
                    agent_version="claims",
                    inventory=self._inventory(),
                )
            )
        self.node_id = enrolled.node_id
        self.session = RawSession(target, enrolled.node_id, enrolled.node_credential)
        await self.session.open()
        local = pb.LocalModel(file_name="m.gguf", sha256=self.sha256, **self.claim)
        report = pb.ResourceReport(inventory=self._inventory(), models=[local])
        await self.session.send(pb.AgentMessage(resource_report=report))
        self._tasks = [asyncio.create_task(self._beat()), asyncio.create_task(self._serve())]
        return self

    async def _beat(self) -> None:
        assert self.session is not None
        while True:
            heartbeat = pb.Heartbeat(
                sent_at_unix_ms=int(time.time() * 1000), cpu_percent=1.0, ram_free_bytes=FAKE_MEMORY
            )
            await self.session.send(pb.AgentMessage(heartbeat=heartbeat))
            await asyncio.sleep(0.2)

    async def _serve(self) -> None:
        session = self.session
        assert session is not None
        seen = 1
        while True:
            await asyncio.sleep(0.01)
            while seen < len(session.received):
                await self._handle(session, session.received[seen])
                seen += 1

    async def _handle(self, session: RawSession, message: pb.ControllerMessage) -> None:
        kind = message.WhichOneof("payload")
        if kind == "execution_plan":
            job = message.execution_plan.job_id
            self.plans.append(job)
            await session.send(
                pb.AgentMessage(setup_result=pb.SetupResult(job_id=job, ok=True, role="primary"))
            )
            deltas = [pb.Delta(seq=i, text=" tok", tokens=1) for i in range(3)]
            await session.send(
                pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job, deltas=deltas))
            )
            result = pb.JobResult(job_id=job, ok=True, finish_reason="stop", completion_tokens=3)
            await session.send(pb.AgentMessage(job_result=result))
        elif kind == "prove_model":
            self.challenges += 1
            if self.content is None:
                return  # it cannot prove anything, so it stays silent
            challenge = message.prove_model
            digests = [
                hashlib.sha256(
                    challenge.nonce + self.content[r.offset : r.offset + r.length]
                ).digest()
                for r in challenge.ranges
            ]
            proof = pb.ModelProof(
                challenge_id=challenge.challenge_id,
                model_sha256=challenge.model_sha256,
                digests=digests,
            )
            await session.send(pb.AgentMessage(model_proof=proof))

    async def drop(self) -> None:
        """Goes silent without a goodbye (the health sweep takes it offline)."""
        for task in self._tasks:
            task.cancel()
        if self.session is not None:
            await self.session.drop()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.session is not None:
            await self.session.close()


# ---------------------------------------------------------------------------- observing


def codes(ctl: RunningController, node_id: str) -> list[str]:
    return [code_of(e) for e in ctl.services.app.events.get(UUID(node_id))]


def row(ctl: RunningController, node_id: str) -> dict[str, Any]:
    found = ctl.services.read_model.get_node(node_id)
    assert found is not None
    return found


def reported(ctl: RunningController, node_id: str, sha256: str) -> bool:
    """The node's report of the file is in the views."""
    return any(m["sha256"] == sha256 for m in row(ctl, node_id)["local_models"])


def proven(ctl: RunningController, node_id: str, sha256: str) -> bool:
    """The node proved it holds the file (MODEL_PROVEN) and still claims it so."""
    return sha256 in (row(ctl, node_id).get("proven_models") or {})


def may_serve(ctl: RunningController, node_id: str, sha256: str) -> bool:
    """The node is eligible and the scheduler counts the file as there."""
    return any(
        e["node_id"] == node_id and sha256 in e["local_models"]
        for e in ctl.services.read_model.eligibility()
    )


async def admin_model(ctl: RunningController) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as http:
        answer = await http.get("/api/admin/models", headers=ADMIN)
    assert answer.status_code == 200, answer.text
    [model] = [m for m in answer.json()["data"] if m["name"] == "m"]
    return dict(model)


def planned(ctl: RunningController) -> ExecutionPlan | None:
    """The plan the planner would give model m now (None: none)."""
    model = ctl.services.read_model.get_model("m")
    assert model is not None
    plan: ExecutionPlan | None = ctl.jobs.scheduler.place(model).plan
    return plan


def sized_by(shape: dict[str, Any], plan: ExecutionPlan) -> bool:
    """Whether ``plan`` needs what the file of ``shape`` needs (with its slots' context)."""
    needs = ModelNeeds(
        "m",
        plan.model_sha256,
        "m.gguf",
        shape["size_bytes"],
        shape["layers"],
        shape["kv_bytes_per_token"],
        shape["context_length"],
    )
    return plan.required_bytes == required_bytes(needs, plan.context_size * plan.parallel)


@contextlib.asynccontextmanager
async def running(session: AgentSession) -> Any:
    task = asyncio.create_task(session.run())
    try:
        await session.wait_for_state(AgentState.READY, timeout=20)
        yield session
    finally:
        await session.stop()
        with contextlib.suppress(Exception):
            await task


def forged(shape: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**shape, **changes}


# -------------------------------------------------------------------------------- attacks


async def test_a_forged_claim_of_a_stored_model_is_refused_recorded_and_never_primary(
    ctl: RunningController, tmp_path: Path
) -> None:
    """(a) 64 GiB, a forged size and shape: the fake is not planned, its claim is refused and
    recorded, and the model's size and shape stay the store's for the admin API and planner."""
    _, sha, shape = stored_model(ctl, tmp_path / "models")
    session, handler = honest_agent(ctl, tmp_path, "honest", tmp_path / "models")
    async with running(session):
        honest = str(session.node_id)
        await until(lambda: may_serve(ctl, honest, sha), 15)
        fake = await ClaimingNode(
            ctl,
            "fake",
            sha,
            forged(shape, size_bytes=64 * GIB, layers=1, context_length=1 << 20),
        ).start()
        await until(lambda: reported(ctl, fake.node_id, sha), 10)

        answer = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
        assert answer["text"] == HONEST_WORDS, answer
        assert fake.plans == [] and len(handler.jobs) == 1
        await until(lambda: "MODEL_CLAIM_REFUSED" in codes(ctl, fake.node_id), 10)
        assert "MODEL_PROVEN" not in codes(ctl, fake.node_id)
        refused = row(ctl, fake.node_id)["refused_models"][sha]
        assert "size" in refused["reason"], refused
        model = await admin_model(ctl)
        assert model["shape"] == shape and model["shape_from"] == "store"
        assert model["held_by"] == ["honest"]
        plan = planned(ctl)
        assert plan is not None and plan.primary.node_id == honest and sized_by(shape, plan)
        await fake.stop()


async def test_a_forged_size_reported_first_does_not_break_a_pull(
    ctl: RunningController, tmp_path: Path
) -> None:
    """(b) The first node to report the file claims 1 TiB: a pull onto a node with 1 GiB of
    room still starts (the size is the store's), from the store, and the file arrives."""
    path, sha, shape = stored_model(ctl, tmp_path / "original")
    fake = await ClaimingNode(
        ctl, "first", sha, forged(shape, size_bytes=1 << 40), serves_files=True
    ).start()
    await until(lambda: reported(ctl, fake.node_id, sha), 10)
    session, _ = honest_agent(ctl, tmp_path, "puller", None)
    async with running(session):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as http:
            pulled = await http.post(
                "/api/admin/models/pull", headers=ADMIN, json={"model": "m", "nodes": ["puller"]}
            )
        assert pulled.status_code == 202, pulled.text
        assert pulled.json()["transfers"][0]["sources"] == ["controller"]
        await until(lambda: may_serve(ctl, str(session.node_id), sha), 20)
        assert (tmp_path / "puller" / "models" / "m.gguf").read_bytes() == path.read_bytes()
        await until(lambda: proven(ctl, str(session.node_id), sha), 10)
        assert not proven(ctl, fake.node_id, sha)
    await fake.stop()


async def test_a_forged_shape_reported_first_does_not_make_the_model_unservable(
    ctl: RunningController, tmp_path: Path
) -> None:
    """(b) The first report claims 1 GiB of KV cache per token: a request still finds a node
    to fetch the stored file onto, and is served there instead of 503 no_capacity."""
    _, sha, shape = stored_model(ctl, tmp_path / "original")
    fake = await ClaimingNode(
        ctl, "first", sha, forged(shape, kv_bytes_per_token=GIB, size_bytes=1 << 40)
    ).start()
    await until(lambda: reported(ctl, fake.node_id, sha), 10)
    session, handler = honest_agent(ctl, tmp_path, "empty", None)
    async with running(session):
        answer = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
        assert answer["error"] is None and answer["text"] == HONEST_WORDS, answer
        assert len(handler.jobs) == 1 and fake.plans == []
    await fake.stop()


async def test_a_revoked_node_leaves_no_trace_in_a_models_shape(
    ctl: RunningController, tmp_path: Path
) -> None:
    """(c) Only nodes hold the file. The first node to claim it proves what it likes (nobody
    can tell) and fixes a shape no node can serve (32 MiB of KV cache per token: plausible,
    but 64 GiB of context): 503. Once it is revoked, that shape counts for nothing: the
    honest node's claim fixes the real one, and serves."""
    _, sha, shape = tiny_model(tmp_path / "models")
    ctl.services.app.register_model("m", sha, "m.gguf", 2048)
    liar = await ClaimingNode(
        ctl,
        "liar",
        sha,
        forged(shape, kv_bytes_per_token=32 << 20),
        content=bytes(shape["size_bytes"]),
    ).start()
    await until(lambda: reported(ctl, liar.node_id, sha), 10)
    refused = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
    assert refused["error"] is not None and refused["error"]["code"] == "no_capacity", refused
    session, _ = honest_agent(ctl, tmp_path, "honest", tmp_path / "models")
    async with running(session):
        honest = str(session.node_id)
        await until(lambda: reported(ctl, honest, sha), 10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl.http_port}") as http:
            revoked = await http.post(f"/api/admin/nodes/{liar.node_id}/revoke", headers=ADMIN)
        assert revoked.status_code == 200, revoked.text
        answer = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
        assert answer["error"] is None and answer["text"] == HONEST_WORDS, answer
        model = await admin_model(ctl)
        assert model["shape"] == shape and model["shape_from"] == honest
        assert model["held_by"] == ["honest"]
        fixed = [
            getattr(e, "source", "")
            for e in ctl.services.app.events.get(model_id("m"))
            if code_of(e) == "MODEL_SHAPE_FIXED"
        ]
        assert fixed == [liar.node_id, honest]
    await liar.drop()


async def test_an_offline_node_leaves_no_trace_in_a_models_shape(
    ctl: RunningController, tmp_path: Path
) -> None:
    """(c) A node reports a forged shape first, then goes silent and is taken offline: the
    model is served by the node that holds the file, and lists only it."""
    _, sha, shape = tiny_model(tmp_path / "models")
    ctl.services.app.register_model("m", sha, "m.gguf", 2048)
    gone = await ClaimingNode(ctl, "gone", sha, forged(shape, kv_bytes_per_token=GIB)).start()
    await until(lambda: reported(ctl, gone.node_id, sha), 10)
    await gone.drop()
    await until(lambda: row(ctl, gone.node_id)["state"] == "OFFLINE", 15)
    session, _ = honest_agent(ctl, tmp_path, "honest", tmp_path / "models")
    async with running(session):
        honest = str(session.node_id)
        await until(lambda: reported(ctl, honest, sha), 10)
        answer = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
        assert answer["error"] is None and answer["text"] == HONEST_WORDS, answer
        model = await admin_model(ctl)
        assert model["held_by"] == ["honest"] and model["shape"] == shape
        assert model["shape_from"] == honest  # the silent node fixed nothing


async def test_only_a_node_that_answers_the_range_challenge_is_primary(
    ctl: RunningController, tmp_path: Path
) -> None:
    """(d) Two nodes claim the stored file exactly as it is, each with 64 GiB: the one whose
    bytes are not the file's answers the challenge wrongly and is never the primary (its
    claim is refused and recorded); the one that holds the file proves it and is."""
    path, sha, shape = stored_model(ctl, tmp_path / "models")
    session, handler = honest_agent(ctl, tmp_path, "honest", tmp_path / "models")
    async with running(session):
        honest = str(session.node_id)
        await until(lambda: may_serve(ctl, honest, sha), 15)
        blank = b"\0" * shape["size_bytes"]
        pretender = await ClaimingNode(ctl, "pretender", sha, shape, content=blank).start()
        await until(lambda: reported(ctl, pretender.node_id, sha), 10)
        answer = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
        assert answer["text"] == HONEST_WORDS, answer
        await until(lambda: "MODEL_CLAIM_REFUSED" in codes(ctl, pretender.node_id), 10)
        assert pretender.plans == [] and pretender.challenges >= 1
        assert "challenge" in row(ctl, pretender.node_id)["refused_models"][sha]["reason"]
        await pretender.stop()
    # The honest node stops (its warm server would take the next job first).
    holder = await ClaimingNode(ctl, "holder", sha, shape, content=path.read_bytes()).start()
    await until(lambda: proven(ctl, holder.node_id, sha), 10)
    assert "MODEL_PROVEN" in codes(ctl, holder.node_id)
    answer = await stream_completion(f"http://127.0.0.1:{ctl.http_port}")
    assert answer["text"] == " tok tok tok", answer
    assert len(holder.plans) == 1 and len(handler.jobs) == 1
    await holder.stop()
