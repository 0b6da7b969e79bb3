"""FakeAgent: speaks the real control protocol but fakes llama.cpp (for fast job-flow tests).
It proves it holds the model it reports with the bytes of a virtual file (see
``bench.synthetic_agents.virtual_bytes``): every FakeAgent holding one sha256 agrees.

The real agent with real llama.cpp is tested end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from bench.synthetic_agents import proof_of
from common.contract import SLOTS_LABEL
from tests.integration.control_client import RawSession, Target, as_target, enroll, inventory
from wire import control_pb2 as pb

ADMIN = {"Authorization": "Bearer test-admin-key"}


async def register_model_m(client: httpx.AsyncClient, sha: str) -> None:
    """Registers model ``m`` (file ``m.gguf``) with the sha256 a FakeAgent ``holds``."""
    r = await client.post(
        "/api/admin/models",
        headers=ADMIN,
        json={"name": "m", "sha256": sha, "file_name": "m.gguf"},
    )
    assert r.status_code == 201, r.text


class FakeAgent:
    def __init__(
        self,
        target: Target,
        token: str,
        name: str,
        *,
        holds: str = "",
        memory: int = 160 << 20,
        words: tuple[str, ...] = ("Hello", " world"),
        address: str = "127.0.0.1",
        slots: int = 1,
        enrolled: tuple[str, str] | None = None,
    ):
        """``enrolled``: (node id, credential) of a node already in the store (no Enroll)."""
        self.enrolled = enrolled
        self.target, self.token, self.name = target, token, name
        self.holds = holds  # sha256 of the model file it reports
        self.memory = memory
        self.address = address
        self.slots = slots
        self.words = words
        self.unresponsive = False
        self.fail_setup: pb.SetupResult | None = None
        self.word_delay = 0.0
        #: What its job results say of the prompt: its tokens, and those from the cache.
        self.prompt_tokens = 7
        self.cached_prompt_tokens = 0
        self.session: RawSession | None = None
        self.node_id = ""
        self.plans: list[pb.ExecutionPlan] = []
        self.cancelled: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> FakeAgent:
        inv = inventory(self.address)
        inv.labels["dacp.memory_limit_bytes"] = str(self.memory)
        inv.labels[SLOTS_LABEL] = str(self.slots)

        from wire import control_pb2_grpc as pb_grpc

        if self.enrolled is not None:
            node_id, credential = self.enrolled
        else:
            async with as_target(self.target).channel() as channel:
                stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
                response = await stub.Enroll(
                    pb.EnrollRequest(
                        enrollment_token=self.token,
                        node_name=self.name,
                        agent_version="fake",
                        inventory=inv,
                    )
                )
            node_id, credential = response.node_id, response.node_credential
        self.node_id = node_id
        self.session = RawSession(self.target, node_id, credential)
        await self.session.open()
        models = []
        if self.holds:
            models.append(
                pb.LocalModel(
                    file_name="m.gguf",
                    size_bytes=100 << 20,
                    sha256=self.holds,
                    layers=30,
                    context_length=8192,
                    kv_bytes_per_token=23040,
                    architecture="llama",
                )
            )
        await self.session.send(
            pb.AgentMessage(resource_report=pb.ResourceReport(inventory=inv, models=models))
        )
        self.session.start_heartbeats(0.2)
        self._task = asyncio.create_task(self._serve())
        return self

    async def _serve(self) -> None:
        assert self.session is not None
        seen = 1
        while True:
            await asyncio.sleep(0.01)
            while seen < len(self.session.received):
                message = self.session.received[seen]
                seen += 1
                # Proofs are the agent's own business, not its jobs': answered regardless.
                if not self.unresponsive or message.WhichOneof("payload") == "prove_model":
                    task = asyncio.create_task(self._handle(message))
                    self._handlers.add(task)
                    task.add_done_callback(self._handlers.discard)

    async def _handle(self, message: pb.ControllerMessage) -> None:
        assert self.session is not None
        kind = message.WhichOneof("payload")
        send = self.session.send
        if kind == "start_rpc_worker":
            m = message.start_rpc_worker
            await send(
                pb.AgentMessage(
                    rpc_worker_status=pb.RpcWorkerStatus(
                        job_id=m.job_id, state=pb.RpcWorkerStatus.STARTED, host=m.host, port=m.port
                    )
                )
            )
        elif kind == "execution_plan":
            plan = message.execution_plan
            self.plans.append(plan)
            if self.fail_setup is not None:
                result = pb.SetupResult()
                result.CopyFrom(self.fail_setup)
                result.job_id = plan.job_id
                await send(pb.AgentMessage(setup_result=result))
                return
            await send(
                pb.AgentMessage(
                    setup_result=pb.SetupResult(job_id=plan.job_id, ok=True, role="primary")
                )
            )
            for seq, word in enumerate(self.words):
                if plan.job_id in self.cancelled:
                    return
                await asyncio.sleep(self.word_delay)
                await send(
                    pb.AgentMessage(
                        token_chunk=pb.TokenChunk(
                            job_id=plan.job_id, deltas=[pb.Delta(seq=seq, text=word, tokens=1)]
                        )
                    )
                )
            if plan.job_id in self.cancelled:
                return
            await send(
                pb.AgentMessage(
                    job_result=pb.JobResult(
                        job_id=plan.job_id,
                        ok=True,
                        finish_reason="stop",
                        prompt_tokens=self.prompt_tokens,
                        cached_prompt_tokens=self.cached_prompt_tokens,
                        completion_tokens=len(self.words),
                        time_to_first_token_ms=5.0,
                        tokens_per_second=100.0,
                    )
                )
            )
        elif kind == "cancel_job":
            self.cancelled.append(message.cancel_job.job_id)
        elif kind == "prove_model" and message.prove_model.model_sha256 == self.holds:
            await send(pb.AgentMessage(model_proof=proof_of(message.prove_model, 100 << 20)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.session is not None:
            await self.session.close()


__all__ = ["FakeAgent", "enroll"]
_: Any = None
