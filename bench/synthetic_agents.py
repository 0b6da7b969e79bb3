"""Synthetic node agents for the capacity benchmark: the real control protocol, no llama.cpp.

Each agent enrolls with a token, opens its Connect stream, reports a model file (or none, for
idle nodes), heartbeats at the controller's interval, and answers the controller like the real
agent: ``StartRpcWorker`` → ``RpcWorkerStatus STARTED``; a primary ``ExecutionPlan`` →
``SetupResult ok``, then ``--tokens`` tokens in ``TokenChunk`` messages of
``--tokens-per-message`` tokens every ``--message-interval`` seconds, then ``JobResult``;
``CancelJob`` stops the stream; ``ProveModel`` → ``ModelProof`` over the bytes of a virtual
file (the same for every synthetic agent reporting one sha256: the first proof fixes the
model's facts, the others agree with it). Many agents share one process and a few gRPC
channels.

    python -m bench.synthetic_agents --target 127.0.0.1:50051 --token TOKEN --count 100

Prints ``ready N`` once every agent is connected, runs until SIGTERM or SIGINT, then prints one
JSON line of totals (messages and tokens sent, plans received).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import orjson

from common.contract import (
    CONTROLLER_TLS_NAME,
    DEFAULT_RPC_PORT,
    MEMORY_LIMIT_LABEL,
    SLOTS_LABEL,
)
from wire import control_pb2 as pb
from wire import control_pb2_grpc as pb_grpc

AGENTS_PER_CHANNEL = 50
MIB = 1 << 20
WORD = " tok"


@dataclass
class Options:
    count: int
    slots: int
    memory: int
    holds: str
    tokens: int
    tokens_per_message: int
    message_interval: float
    first_token_delay: float
    name_prefix: str


@dataclass
class Totals:
    messages: int = 0
    tokens: int = 0
    plans: int = 0
    cancels: int = 0
    heartbeats: int = 0
    connected: int = 0
    jobs: set[str] = field(default_factory=set)


def virtual_bytes(sha256: str, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` of the virtual file a synthetic agent "holds" as
    ``sha256``: a 32-byte pattern derived from it, repeated."""
    pattern = hashlib.sha256(sha256.encode()).digest()
    start = offset % len(pattern)
    return (pattern * ((start + length) // len(pattern) + 1))[start : start + length]


def proof_of(challenge: pb.ProveModel, size: int) -> pb.ModelProof:
    """The answer to a challenge about the virtual file (``size`` bytes)."""
    proof = pb.ModelProof(challenge_id=challenge.challenge_id, model_sha256=challenge.model_sha256)
    if any(r.offset + r.length > size for r in challenge.ranges):
        proof.error = "a range goes beyond the file"
        return proof
    proof.digests.extend(
        hashlib.sha256(
            challenge.nonce + virtual_bytes(challenge.model_sha256, r.offset, r.length)
        ).digest()
        for r in challenge.ranges
    )
    return proof


def wire_inventory(
    *,
    hostname: str,
    cpu_model: str,
    ram: int,
    cores: int = 2,
    threads: int = 2,
    disk_total: int = 100 << 30,
    disk_free: int = 50 << 30,
    address: str = "127.0.0.1",
    labels: dict[str, str] | None = None,
) -> pb.Inventory:
    """What a fake Linux x86_64 node reports of itself (RPC on the default port), as sent."""
    inv = pb.Inventory(
        hostname=hostname,
        os="Linux",
        arch="x86_64",
        cpu_model=cpu_model,
        cpu_cores=cores,
        cpu_threads=threads,
        ram_total_bytes=ram,
        disk_total_bytes=disk_total,
        disk_free_bytes=disk_free,
        advertised_address=address,
        rpc_port=DEFAULT_RPC_PORT,
    )
    inv.labels.update(labels or {})
    return inv


def inventory(memory: int, slots: int) -> pb.Inventory:
    labels = {MEMORY_LIMIT_LABEL: str(memory), SLOTS_LABEL: str(slots)}
    return wire_inventory(hostname="synthetic", cpu_model="synthetic", ram=64 << 30, labels=labels)


class Agent:
    def __init__(self, channel: grpc.aio.Channel, name: str, opts: Options, totals: Totals):
        self.stub = pb_grpc.ControlPlaneStub(channel)  # type: ignore[no-untyped-call]
        self.name = name
        self.opts = opts
        self.totals = totals
        self.outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        self.cancelled: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.interval = 2.0

    async def enroll(self, token: str) -> tuple[str, str]:
        response = await self.stub.Enroll(
            pb.EnrollRequest(
                enrollment_token=token,
                node_name=self.name,
                agent_version="synthetic",
                inventory=inventory(self.opts.memory, self.opts.slots),
            )
        )
        self.interval = response.heartbeat_interval_seconds or self.interval
        return response.node_id, response.node_credential

    async def _requests(self, node_id: str) -> AsyncIterator[pb.AgentMessage]:
        yield pb.AgentMessage(hello=pb.Hello(agent_version="synthetic", node_id=node_id))
        while (item := await self.outbox.get()) is not None:
            yield item

    async def run(self, token: str, connected: asyncio.Event) -> None:
        node_id, credential = await self.enroll(token)
        metadata = (("x-node-id", node_id), ("x-node-credential", credential))
        call = self.stub.Connect(self._requests(node_id), metadata=metadata)
        welcome = await call.read()
        self.interval = welcome.welcome.heartbeat_interval_seconds or self.interval
        models = []
        if self.opts.holds:
            models.append(
                pb.LocalModel(
                    file_name="m.gguf",
                    size_bytes=100 * MIB,
                    sha256=self.opts.holds,
                    layers=30,
                    context_length=8192,
                    kv_bytes_per_token=1024,
                    architecture="llama",
                )
            )
        inv = inventory(self.opts.memory, self.opts.slots)
        self.outbox.put_nowait(
            pb.AgentMessage(resource_report=pb.ResourceReport(inventory=inv, models=models))
        )
        self.totals.connected += 1
        if self.totals.connected == self.opts.count:
            connected.set()
        beat = asyncio.create_task(self._heartbeats())
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                self._handle(message)
        finally:
            beat.cancel()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.totals.heartbeats += 1
            self.outbox.put_nowait(
                pb.AgentMessage(
                    heartbeat=pb.Heartbeat(
                        sent_at_unix_ms=int(time.time() * 1000),
                        cpu_percent=5.0,
                        ram_free_bytes=32 << 30,
                    )
                )
            )

    def _handle(self, message: pb.ControllerMessage) -> None:
        kind = message.WhichOneof("payload")
        if kind == "start_rpc_worker":
            m = message.start_rpc_worker
            status = pb.RpcWorkerStatus(
                job_id=m.job_id, state=pb.RpcWorkerStatus.STARTED, host=m.host, port=m.port
            )
            self.outbox.put_nowait(pb.AgentMessage(rpc_worker_status=status))
        elif kind == "execution_plan" and message.execution_plan.role == pb.ExecutionPlan.PRIMARY:
            self.totals.plans += 1
            task = asyncio.create_task(self._generate(message.execution_plan.job_id))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif kind == "cancel_job":
            self.totals.cancels += 1
            self.cancelled.add(message.cancel_job.job_id)
        elif kind == "prove_model" and message.prove_model.model_sha256 == self.opts.holds:
            proof = proof_of(message.prove_model, 100 * MIB)
            self.outbox.put_nowait(pb.AgentMessage(model_proof=proof))

    async def _generate(self, job_id: str) -> None:
        opts = self.opts
        send = self.outbox.put_nowait
        send(pb.AgentMessage(setup_result=pb.SetupResult(job_id=job_id, ok=True, role="primary")))
        await asyncio.sleep(opts.first_token_delay)
        seq = 0
        while seq < opts.tokens:
            if job_id in self.cancelled:
                return
            n = min(opts.tokens_per_message, opts.tokens - seq)
            deltas = [pb.Delta(seq=seq + i, text=WORD, tokens=1) for i in range(n)]
            send(pb.AgentMessage(token_chunk=pb.TokenChunk(job_id=job_id, deltas=deltas)))
            seq += n
            self.totals.messages += 1
            self.totals.tokens += n
            if seq < opts.tokens:
                await asyncio.sleep(opts.message_interval)
        send(
            pb.AgentMessage(
                job_result=pb.JobResult(
                    job_id=job_id,
                    ok=True,
                    finish_reason="length",
                    prompt_tokens=8,
                    completion_tokens=opts.tokens,
                    time_to_first_token_ms=opts.first_token_delay * 1000,
                    tokens_per_second=opts.tokens_per_message / max(opts.message_interval, 1e-3),
                )
            )
        )
        self.totals.jobs.add(job_id)


def _channel(target: str, ca_pem: bytes | None) -> grpc.aio.Channel:
    """Plaintext without a CA; TLS verified against it otherwise (as agents that pinned it)."""
    if ca_pem is None:
        return grpc.aio.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    options = [("grpc.ssl_target_name_override", CONTROLLER_TLS_NAME)]
    return grpc.aio.secure_channel(target, credentials, options=options)


async def run(target: str, token: str, opts: Options, ca_pem: bytes | None = None) -> Totals:
    totals = Totals()
    channels = [
        _channel(target, ca_pem)
        for _ in range((opts.count + AGENTS_PER_CHANNEL - 1) // AGENTS_PER_CHANNEL)
    ]
    agents = [
        Agent(channels[i // AGENTS_PER_CHANNEL], f"{opts.name_prefix}{i:04d}", opts, totals)
        for i in range(opts.count)
    ]
    connected = asyncio.Event()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    for agent in agents:  # enroll a few at a time: each enrollment is a store write
        tasks.append(asyncio.create_task(agent.run(token, connected)))
        if len(tasks) % 20 == 0:
            await asyncio.sleep(0.05)
    waiter = asyncio.create_task(connected.wait())
    stopper = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(_first_failure(tasks))
    await asyncio.wait({waiter, stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done() and failed.exception() is not None:
        raise failed.exception()  # type: ignore[misc]
    if connected.is_set():
        print(f"ready {opts.count}", flush=True)
    await stop.wait()
    for task in tasks:
        task.cancel()
    for channel in channels:
        await channel.close(None)
    with contextlib.suppress(asyncio.CancelledError):
        failed.cancel()
    return totals


async def _first_failure(tasks: list[asyncio.Task[None]]) -> None:
    for done in asyncio.as_completed(tasks):
        await done  # raises the first agent's failure


def parse_args(argv: list[str] | None = None) -> tuple[str, str, Options, bytes | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.synthetic_agents")
    parser.add_argument("--target", required=True, help="controller gRPC host:port")
    parser.add_argument("--token", required=True, help="a multi-use enrollment token")
    parser.add_argument(
        "--ca-file", type=Path, default=None, help="the controller's CA (TLS); else plaintext"
    )
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--memory", type=int, default=1024 * MIB, help="bytes each offers")
    parser.add_argument("--holds", default="", help="sha256 of the model each reports")
    parser.add_argument("--tokens", type=int, default=500, help="tokens per job")
    parser.add_argument("--tokens-per-message", type=int, default=4)
    parser.add_argument("--message-interval", type=float, default=0.2)
    parser.add_argument("--first-token-delay", type=float, default=0.0)
    parser.add_argument("--name-prefix", default="synthetic-")
    args = parser.parse_args(argv)
    opts = Options(
        count=args.count,
        slots=args.slots,
        memory=args.memory,
        holds=args.holds,
        tokens=args.tokens,
        tokens_per_message=args.tokens_per_message,
        message_interval=args.message_interval,
        first_token_delay=args.first_token_delay,
        name_prefix=args.name_prefix,
    )
    ca_pem = args.ca_file.read_bytes() if args.ca_file is not None else None
    return args.target, args.token, opts, ca_pem


def main(argv: list[str] | None = None) -> int:
    target, token, opts, ca_pem = parse_args(argv)
    totals = asyncio.run(run(target, token, opts, ca_pem))
    summary: dict[str, Any] = {
        "messages": totals.messages,
        "tokens": totals.tokens,
        "plans": totals.plans,
        "cancels": totals.cancels,
        "heartbeats": totals.heartbeats,
        "jobs_finished": len(totals.jobs),
    }
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
