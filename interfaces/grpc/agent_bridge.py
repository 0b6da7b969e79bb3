"""Protobuf on one side, the job manager on the other: the gateway down and the uplink up."""

from __future__ import annotations

import orjson

from application.agent_messages import (
    AgentJobMessage,
    AgentJobResult,
    JobFinished,
    Rejection,
    SetupOutcome,
    SetupReported,
    TokensGenerated,
    WorkerStatus,
    WorkerStopped,
)
from application.commands import (
    Delta,
    EmbeddingInputs,
    FetchRequest,
    JobInput,
    JobParams,
    TextPrompt,
    TransferReport,
)
from application.job_manager import JobManager
from application.link_probes import LinkMeasure, LinkProbes
from application.model_claims import ModelClaims, ProofAnswer, ProofChallenge
from application.model_transfers import TransferCoordinator
from application.ports import AllowedPeer, LinkProbeRequest, PrimaryAssignment
from domain.bounded_text import ID_MAX, bounded
from interfaces.grpc.grpc_server import AgentConnections
from wire import control_pb2 as pb


class ProtoAgentGateway:
    """:class:`application.ports.AgentGateway` over the open Connect streams."""

    def __init__(self, connections: AgentConnections) -> None:
        self.connections = connections

    def is_connected(self, node_id: str) -> bool:
        return self.connections.is_connected(node_id)

    def start_rpc_worker(
        self,
        node_id: str,
        job_id: str,
        host: str,
        port: int,
        allowed: tuple[AllowedPeer, ...],
        devices: tuple[str, ...] = (),
    ) -> bool:
        start = pb.StartRpcWorker(
            job_id=job_id,
            host=host,
            port=port,
            allowed_peers=sorted({peer.address for peer in allowed}),
            peers=_peer_access(allowed),
            devices=list(devices),
        )
        message = pb.ControllerMessage(start_rpc_worker=start)
        return self.connections.send(node_id, message)

    def rpc_worker_peers(self, node_id: str, allowed: tuple[AllowedPeer, ...], reason: str) -> bool:
        update = pb.RpcWorkerPeers(peers=_peer_access(allowed), reason=reason)
        return self.connections.send(node_id, pb.ControllerMessage(rpc_worker_peers=update))

    def fetch_model(self, node_id: str, request: FetchRequest) -> bool:
        fetch = pb.FetchModel(
            transfer_id=request.transfer_id,
            model_sha256=request.sha256,
            file_name=request.file_name,
            size_bytes=request.size_bytes,
            sources=[
                pb.TransferSource(
                    node_id=s.node_id, host=s.host, port=s.port, ticket=s.ticket, url=s.url
                )
                for s in request.sources
            ],
            allowed_source_cidrs=list(request.allowed_source_cidrs),
        )
        return self.connections.send(node_id, pb.ControllerMessage(fetch_model=fetch))

    def evict_model(self, node_id: str, sha256: str) -> bool:
        evict = pb.EvictModel(model_sha256=sha256)
        return self.connections.send(node_id, pb.ControllerMessage(evict_model=evict))

    def prove_model(self, node_id: str, challenge: ProofChallenge) -> bool:
        prove = pb.ProveModel(
            challenge_id=challenge.challenge_id,
            model_sha256=challenge.sha256,
            nonce=challenge.nonce,
            ranges=[pb.ByteRange(offset=r.offset, length=r.length) for r in challenge.ranges],
        )
        return self.connections.send(node_id, pb.ControllerMessage(prove_model=prove))

    def stop_rpc_worker(self, node_id: str, reason: str) -> bool:
        stop = pb.StopRpcWorker(reason=reason)
        return self.connections.send(node_id, pb.ControllerMessage(stop_rpc_worker=stop))

    def stop_server(self, node_id: str, reason: str) -> bool:
        stop = pb.StopServer(reason=reason)
        return self.connections.send(node_id, pb.ControllerMessage(stop_server=stop))

    def probe_links(self, node_id: str, request: LinkProbeRequest) -> bool:
        probe = pb.ProbeLinks(
            probe_id=request.probe_id,
            peers=[
                pb.LinkPeer(node_id=p.node_id, host=p.host, port=p.port, ticket=p.ticket)
                for p in request.peers
            ],
            probe_bytes=request.probe_bytes,
        )
        return self.connections.send(node_id, pb.ControllerMessage(probe_links=probe))

    def assign_primary(self, node_id: str, assignment: PrimaryAssignment) -> bool:
        plan = pb.ExecutionPlan(
            job_id=assignment.job_id,
            model_name=assignment.model_name,
            model_file_name=assignment.model_file_name,
            model_sha256=assignment.model_sha256,
            context_size=assignment.context_size,
            parallel=assignment.parallel,
            role=pb.ExecutionPlan.PRIMARY,
            rpc_peers=[
                pb.RpcPeer(node_id=p.node_id, host=p.host, port=p.port)
                for p in assignment.rpc_peers
            ],
            tensor_split=list(assignment.tensor_split),
            embeddings=assignment.embeddings,
            pooling=assignment.pooling,
            devices=[
                pb.PlanDevice(
                    node_id=d.node_id,
                    device=d.device,
                    endpoint=d.endpoint,
                    share=d.share,
                    assigned_bytes=d.assigned_bytes,
                )
                for d in assignment.devices
            ],
        )
        if assignment.n_gpu_layers is not None:
            plan.n_gpu_layers = assignment.n_gpu_layers
        plan.host_bytes = assignment.host_bytes
        _set_job(plan, assignment.prompt, assignment.params)
        return self.connections.send(node_id, pb.ControllerMessage(execution_plan=plan))

    def cancel_job(self, node_id: str, job_id: str, reason: str) -> bool:
        message = pb.ControllerMessage(cancel_job=pb.CancelJob(job_id=job_id, reason=reason))
        return self.connections.send(node_id, message)

    def drain(self, node_id: str) -> bool:
        return self.connections.send(node_id, pb.ControllerMessage(drain=pb.Drain()))

    def resume(self, node_id: str) -> bool:
        return self.connections.send(node_id, pb.ControllerMessage(resume=pb.Resume()))

    def revoke(self, node_id: str) -> bool:
        had_stream = self.connections.disconnect(node_id)
        told = pb.ControllerMessage(nodes_revoked=pb.NodesRevoked(node_ids=[node_id]))
        for other in self.connections.connected():
            if other != node_id:
                self.connections.send(other, told)
        return had_stream


def _set_job(plan: pb.ExecutionPlan, prompt: JobInput, params: JobParams) -> None:
    """The plan's job (chat, completion or embeddings) and, for a generation, its sampling."""
    if isinstance(prompt, EmbeddingInputs):
        if prompt.items and isinstance(prompt.items[0], str):
            plan.embedding.texts.extend(item for item in prompt.items if isinstance(item, str))
        else:
            plan.embedding.tokens.extend(
                pb.TokenIds(ids=item) for item in prompt.items if isinstance(item, list)
            )
        return
    if isinstance(prompt, TextPrompt):
        if isinstance(prompt.text, str):
            plan.completion.text = prompt.text
        else:
            plan.completion.tokens.ids.extend(prompt.text)
    else:
        plan.chat.messages_json = orjson.dumps(prompt.messages).decode()
        plan.chat.tools_json = orjson.dumps(prompt.tools).decode() if prompt.tools else ""
    generation = plan.generation
    generation.max_tokens = params.max_tokens or 0
    generation.stop.extend(params.stop)
    generation.options_json = orjson.dumps(params.options).decode() if params.options else ""
    if params.temperature is not None:
        generation.temperature = params.temperature
    if params.top_p is not None:
        generation.top_p = params.top_p
    if params.seed is not None:
        generation.seed = params.seed


def _peer_access(allowed: tuple[AllowedPeer, ...]) -> list[pb.RpcPeerAccess]:
    return [pb.RpcPeerAccess(node_id=peer.node_id, address=peer.address) for peer in allowed]


#: ModelTransfer.State → TransferReport.state.
_TRANSFER_STATES = {
    pb.ModelTransfer.STARTED: "started",
    pb.ModelTransfer.PROGRESS: "progress",
    pb.ModelTransfer.COMPLETED: "completed",
    pb.ModelTransfer.FAILED: "failed",
}


class JobUplink:
    """The servicer's :class:`application.ports.UplinkHandler`: job messages up, and
    model transfer reports."""

    def __init__(
        self,
        jobs: JobManager,
        transfers: TransferCoordinator | None = None,
        claims: ModelClaims | None = None,
        links: LinkProbes | None = None,
    ) -> None:
        self.jobs = jobs
        self.transfers = transfers
        #: Judges the nodes' answers to model-proof challenges.
        self.claims = claims
        #: Records the links the nodes measured.
        self.links = links

    async def on_agent_message(self, node_id: str, message: pb.AgentMessage) -> Rejection | None:
        kind = message.WhichOneof("payload")
        if kind == "model_transfer":
            return await self._transfer(node_id, message.model_transfer)
        if kind == "model_evicted":
            evicted = message.model_evicted
            if self.transfers is not None:
                await self.transfers.evicted(
                    node_id, evicted.model_sha256, evicted.ok, evicted.file_name, evicted.error
                )
            return None
        if kind == "model_proof":
            return await self._proof(node_id, message.model_proof)
        if kind == "link_report":
            return await self._links(node_id, message.link_report)
        typed = job_message(message)
        if typed is None or isinstance(typed, Rejection):
            return typed
        return await self.jobs.handle(node_id, typed)

    async def _transfer(self, node_id: str, report: pb.ModelTransfer) -> Rejection | None:
        state = _TRANSFER_STATES.get(report.state)
        if state is None or not report.transfer_id:
            return Rejection("a model transfer report without a state or transfer id")
        if self.transfers is not None:
            await self.transfers.reported(
                node_id,
                TransferReport(
                    transfer_id=report.transfer_id,
                    sha256=report.model_sha256,
                    state=state,
                    bytes_done=int(report.bytes_done),
                    size_bytes=int(report.size_bytes),
                    source_node_id=report.source_node_id,
                    error=report.error,
                ),
            )
        return None

    async def _proof(self, node_id: str, proof: pb.ModelProof) -> Rejection | None:
        if self.claims is None:
            return Rejection("a model proof, and this controller sends no challenges")
        answer = ProofAnswer(
            proof.challenge_id, proof.model_sha256, tuple(proof.digests), proof.error
        )
        refused = await self.claims.answer(node_id, answer)
        return None if refused is None else Rejection(refused)

    async def _links(self, node_id: str, report: pb.LinkReport) -> Rejection | None:
        if self.links is None:
            return Rejection("a link report, and this controller sends no link probes")
        measures = [
            LinkMeasure(m.node_id, float(m.rtt_ms), float(m.mbps), m.error) for m in report.links
        ]
        refused = await self.links.reported(node_id, report.probe_id, measures)
        return None if refused is None else Rejection(refused)

    async def on_node_disconnected(self, node_id: str) -> None:
        self.jobs.node_disconnected(node_id)

    async def on_node_gone(self, node_id: str, reason: str = "") -> None:
        await self.jobs.node_gone(node_id, reason)

    async def messages_handled(self) -> None:
        await self.jobs.messages_handled()

    def resumed_jobs(self, node_id: str) -> list[tuple[str, int]]:
        return self.jobs.resumed_jobs(node_id)


_WORKER_STATES = (pb.RpcWorkerStatus.STARTED, pb.RpcWorkerStatus.FAILED)
_JOB_KINDS = frozenset({"rpc_worker_status", "setup_result", "job_result"})


def job_message(message: pb.AgentMessage) -> AgentJobMessage | Rejection | None:
    """The typed job message a protobuf uplink message carries (None: not a job message), or
    why it is malformed."""
    kind = message.WhichOneof("payload")
    if kind == "token_chunk":
        chunk = message.token_chunk
        deltas = [Delta(int(d.seq), d.text, int(d.tokens) or 1, d.extra_json) for d in chunk.deltas]
        if not deltas or not chunk.job_id:
            return Rejection("a token chunk without a job id or deltas", chunk.job_id)
        seq = deltas[0].seq
        for delta in deltas[1:]:
            if delta.seq <= seq:
                return Rejection("token sequence numbers out of order in one chunk", chunk.job_id)
            seq = delta.seq
        return TokensGenerated(chunk.job_id, deltas)
    job_id = getattr(message, kind).job_id if kind in _JOB_KINDS else ""
    if kind == "rpc_worker_status" and not job_id:
        if message.rpc_worker_status.state == pb.RpcWorkerStatus.STOPPED:
            return None  # the answer to a retirement (NODE_RUNTIME_RETIRED is recorded)
    if kind in _JOB_KINDS and not job_id:
        return Rejection(f"a {kind} without a job id")
    if kind == "rpc_worker_status":
        st = message.rpc_worker_status
        if st.state == pb.RpcWorkerStatus.STOPPED:
            return WorkerStopped(st.job_id, st.error or "stopped")
        if st.state in _WORKER_STATES:
            started = st.state == pb.RpcWorkerStatus.STARTED
            return WorkerStatus(
                st.job_id,
                started,
                st.host,
                int(st.port),
                st.error,
                error_code=bounded(st.error_code, ID_MAX),
                failed_device=bounded(st.failed_device, ID_MAX),
                failed_bytes=int(st.failed_bytes),
            )
        return Rejection("an RPC worker status without a state", st.job_id)
    if kind == "setup_result":
        sr = message.setup_result
        outcome = SetupOutcome(
            sr.ok,
            sr.error,
            sr.error_code,
            sr.failed_node_id,
            failed_device=bounded(sr.failed_device, ID_MAX),
            failed_bytes=int(sr.failed_bytes),
        )
        return SetupReported(sr.job_id, outcome)
    if kind == "job_result":
        r = message.job_result
        result = AgentJobResult(
            ok=r.ok,
            finish_reason=r.finish_reason,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            time_to_first_token_ms=r.time_to_first_token_ms,
            tokens_per_second=r.tokens_per_second,
            cached_prompt_tokens=int(r.cached_prompt_tokens),
            error=r.error,
            error_code=r.error_code,
            output=r.output_json,
            failed_node_id=bounded(r.failed_node_id, ID_MAX),
            failed_device=bounded(r.failed_device, ID_MAX),
            failed_bytes=int(r.failed_bytes),
        )
        return JobFinished(r.job_id, result)
    return None
