"""The request typed across layers: a Submission's prompt (chat, completion or embeddings) and
options travel as the plan's ``job`` oneof, and the agent asks llama-server's matching endpoint;
what ``JOB_SUBMITTED`` records keeps its shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from agent.runtime.job_messages import INVALID_PLAN, SetupFailure, job_request
from agent.runtime.llama_server import ChatRequest, EmbeddingsRequest
from application.commands import (
    Caller,
    ChatPrompt,
    EmbeddingInputs,
    JobInput,
    JobParams,
    Submission,
    TextPrompt,
)
from application.ports import PrimaryAssignment
from common.contract import Endpoint
from interfaces.grpc.agent_bridge import ProtoAgentGateway
from interfaces.grpc.grpc_server import AgentConnections
from wire import control_pb2 as pb

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
PARAMS = JobParams(
    max_tokens=8, temperature=0.5, stop=["END"], seed=3, options={"top_k": 20, "logprobs": 1}
)


async def _plan(prompt: JobInput, params: JobParams = PARAMS, **more: Any) -> pb.ExecutionPlan:
    """The plan the gateway sends a node for ``prompt`` (with ``more`` of the assignment's
    fields), taken off the node's stream."""
    connections = AgentConnections()
    connections.bind(asyncio.get_running_loop())
    outbox = connections.open("n1")
    assignment = PrimaryAssignment(
        job_id="j1",
        model_name="m",
        model_file_name="m.gguf",
        model_sha256="a" * 64,
        context_size=64,
        parallel=1,
        rpc_peers=(),
        tensor_split=(),
        prompt=prompt,
        params=params,
        **more,
    )
    assert ProtoAgentGateway(connections).assign_primary("n1", assignment)
    sent = await outbox.get()
    assert isinstance(sent, pb.ControllerMessage)
    return sent.execution_plan


async def test_a_chat_travels_as_a_chat_job_and_asks_chat_completions() -> None:
    plan = await _plan(ChatPrompt(HI, [TOOL]))
    assert plan.WhichOneof("job") == "chat"
    assert json.loads(plan.chat.messages_json) == HI
    assert json.loads(plan.chat.tools_json) == [TOOL]
    assert plan.generation.max_tokens == 8 and plan.generation.seed == 3
    assert not plan.generation.HasField("top_p")
    request = job_request(plan)
    assert isinstance(request, ChatRequest) and request.endpoint == Endpoint.CHAT
    assert request.path == "/v1/chat/completions"
    payload = request.payload()
    assert payload["messages"] == HI and payload["tools"] == [TOOL] and "prompt" not in payload
    assert (payload["max_tokens"], payload["temperature"], payload["stop"]) == (8, 0.5, ["END"])
    assert (payload["top_k"], payload["logprobs"]) == (20, 1)  # the pass-through


async def test_a_chat_without_tools_sends_none() -> None:
    plan = await _plan(ChatPrompt(HI))
    assert plan.chat.tools_json == ""
    request = job_request(plan)
    assert isinstance(request, ChatRequest) and "tools" not in request.payload()


@pytest.mark.parametrize("prompt", ["Once upon", [1, 2, 3]])
async def test_a_completion_travels_as_its_prompt_and_asks_completions(
    prompt: str | list[int],
) -> None:
    plan = await _plan(TextPrompt(prompt))
    assert plan.WhichOneof("job") == "completion"
    assert plan.completion.WhichOneof("prompt") == ("text" if isinstance(prompt, str) else "tokens")
    request = job_request(plan)
    assert isinstance(request, ChatRequest) and request.endpoint == Endpoint.COMPLETIONS
    assert request.path == "/v1/completions"
    payload = request.payload()
    assert payload["prompt"] == prompt and "messages" not in payload
    assert payload["max_tokens"] == 8 and payload["top_k"] == 20


@pytest.mark.parametrize("inputs", [["a", "b"], [[1, 2], [3]]])
async def test_embeddings_travel_as_their_inputs_without_sampling(
    inputs: list[str] | list[list[int]],
) -> None:
    plan = await _plan(EmbeddingInputs(inputs), JobParams())
    assert plan.WhichOneof("job") == "embedding"
    assert not plan.HasField("generation")
    request = job_request(plan)
    assert isinstance(request, EmbeddingsRequest)
    assert [item if isinstance(item, str) else list(item) for item in request.inputs] == inputs


@pytest.mark.parametrize(
    "plan",
    [
        pb.ExecutionPlan(job_id="j"),  # no job at all
        pb.ExecutionPlan(chat=pb.ChatJob(messages_json="")),
        pb.ExecutionPlan(chat=pb.ChatJob(messages_json=json.dumps(HI), tools_json="{}")),
        pb.ExecutionPlan(completion=pb.CompletionJob()),
        pb.ExecutionPlan(completion=pb.CompletionJob(text="")),
        pb.ExecutionPlan(completion=pb.CompletionJob(tokens=pb.TokenIds())),
        pb.ExecutionPlan(embedding=pb.EmbeddingJob()),
        pb.ExecutionPlan(embedding=pb.EmbeddingJob(texts=["a"], tokens=[pb.TokenIds(ids=[1])])),
        pb.ExecutionPlan(embedding=pb.EmbeddingJob(tokens=[pb.TokenIds()])),
    ],
)
def test_a_plan_without_a_well_formed_job_is_invalid(plan: pb.ExecutionPlan) -> None:
    with pytest.raises(SetupFailure) as caught:
        job_request(plan)
    assert caught.value.error_code == INVALID_PLAN


def test_what_job_submitted_records_keeps_its_shape() -> None:
    caller = Caller(user="u", metadata={"k": "v"})
    chat = Submission("m", ChatPrompt(HI, [TOOL]), JobParams(max_tokens=4, caller=caller), True)
    assert chat.endpoint == Endpoint.CHAT
    assert chat.recorded_messages() == HI
    assert chat.recorded_params() == {
        "max_tokens": 4,
        "temperature": None,
        "top_p": None,
        "stop": [],
        "seed": None,
        "include_usage": False,
        "top_logprobs": None,
        "forced_tools": None,
        "options": {"tools": [TOOL]},
        "user": "u",
        "metadata": {"k": "v"},
    }
    completion = Submission("m", TextPrompt([5, 6]), JobParams(max_tokens=16))
    assert completion.recorded_messages() == [{"role": "prompt", "content": [5, 6]}]
    recorded = completion.recorded_params()
    assert recorded["endpoint"] == "completions" and "forced_tools" not in recorded
    embeddings = Submission("e", EmbeddingInputs(["a", "b"]), JobParams(caller=Caller(user="u")))
    assert embeddings.recorded_params() == {"endpoint": "embeddings", "user": "u"}
    assert embeddings.recorded_messages() == [
        {"role": "input", "content": "a"},
        {"role": "input", "content": "b"},
    ]


async def test_the_plan_says_what_host_memory_it_gives_the_server() -> None:
    """What the agent sizes the server's prompt cache from (test_prompt_cache_size.py)."""
    plan = await _plan(ChatPrompt(HI, []), host_bytes=3 << 30)
    assert plan.HasField("host_bytes") and plan.host_bytes == 3 << 30
