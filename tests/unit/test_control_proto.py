"""Shape of the control protocol: services, oneofs, optional presence, round trips."""

from __future__ import annotations

import json

import pytest
from google.protobuf.message import Message

from common.contract import PROTOCOL_VERSION
from wire import control_pb2 as pb


def test_service_methods_and_streaming() -> None:
    service = pb.DESCRIPTOR.services_by_name["ControlPlane"]
    enroll = service.methods_by_name["Enroll"]
    connect = service.methods_by_name["Connect"]
    assert enroll.input_type.name == "EnrollRequest"
    assert enroll.output_type.name == "EnrollResponse"
    assert (enroll.client_streaming, enroll.server_streaming) == (False, False)
    assert connect.input_type.name == "AgentMessage"
    assert connect.output_type.name == "ControllerMessage"
    assert (connect.client_streaming, connect.server_streaming) == (True, True)
    assert pb.DESCRIPTOR.package == PROTOCOL_VERSION == "dacp.control.v1"


@pytest.mark.parametrize(
    ("message", "members"),
    [
        (
            pb.AgentMessage,
            "hello heartbeat resource_report setup_result rpc_worker_status token_chunk "
            "job_result runtime_fault goodbye model_transfer model_evicted model_proof stopping "
            "link_report",
        ),
        (
            pb.ControllerMessage,
            "welcome execution_plan start_rpc_worker stop_rpc_worker cancel_job drain resume "
            "message_rejected fetch_model evict_model nodes_revoked rpc_worker_peers prove_model "
            "stop_server probe_links",
        ),
    ],
)
def test_message_oneof_members(message: type[Message], members: str) -> None:
    """The payload oneof's members, in field order."""
    oneof = message.DESCRIPTOR.oneofs_by_name["payload"]
    assert [f.name for f in oneof.fields] == members.split()


def test_empty_drain_is_still_a_set_oneof() -> None:
    msg = pb.ControllerMessage(drain=pb.Drain())
    decoded = pb.ControllerMessage.FromString(msg.SerializeToString())
    assert decoded.WhichOneof("payload") == "drain"


def test_optional_generation_params_keep_presence() -> None:
    params = pb.GenerationParams(max_tokens=16, temperature=0.0)
    decoded = pb.GenerationParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature") and decoded.temperature == 0.0
    assert not decoded.HasField("top_p")
    assert not decoded.HasField("seed")


def test_execution_plan_round_trip() -> None:
    messages = [{"role": "user", "content": "hi"}]
    plan = pb.ExecutionPlan(
        job_id="job-1",
        model_name="smollm2",
        model_file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_sha256="b" * 64,
        context_size=2048,
        role=pb.ExecutionPlan.PRIMARY,
        rpc_peers=[pb.RpcPeer(node_id="n2", host="10.0.0.2", port=50052)],
        tensor_split=[0.5, 0.5],
        generation=pb.GenerationParams(max_tokens=32, stop=["</s>"], seed=7),
        chat=pb.ChatJob(messages_json=json.dumps(messages)),
    )
    wrapped = pb.ControllerMessage(execution_plan=plan)
    decoded = pb.ControllerMessage.FromString(wrapped.SerializeToString()).execution_plan
    assert decoded == plan
    assert decoded.role == pb.ExecutionPlan.PRIMARY
    assert decoded.WhichOneof("job") == "chat"
    assert json.loads(decoded.chat.messages_json) == messages
    assert decoded.generation.seed == 7


def test_token_chunk_carries_ordered_deltas() -> None:
    chunk = pb.TokenChunk(
        job_id="job-1",
        deltas=[pb.Delta(seq=0, text="Hel", tokens=1), pb.Delta(seq=1, text="lo", tokens=1)],
    )
    decoded = pb.AgentMessage.FromString(pb.AgentMessage(token_chunk=chunk).SerializeToString())
    assert [(d.seq, d.text, d.tokens) for d in decoded.token_chunk.deltas] == [
        (0, "Hel", 1),
        (1, "lo", 1),
    ]


def test_rpc_worker_state_enum() -> None:
    status = pb.RpcWorkerStatus(job_id="j", state=pb.RpcWorkerStatus.STARTED, host="10.0.0.2")
    assert pb.RpcWorkerStatus.State.Name(status.state) == "STARTED"
    assert pb.RpcWorkerStatus.FAILED != pb.RpcWorkerStatus.STOPPED
