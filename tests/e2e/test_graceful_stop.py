"""End to end: graceful stops on a local cluster (real controller, real agents, real llama.cpp).

An agent that gets SIGINT while it streams a chat completion drains: the client receives its
whole answer, the agent exits 0, and the node's events say NODE_STOPPING then NODE_STOPPED with
no job lost. Another agent gets a second SIGINT while it drains: it stops at once (exit 130),
the client hears its job was lost, and NODE_STOPPED lists the job. Then the controller gets
SIGTERM while a stream runs on the last agent: it logs what it waits for, exits 0 within
SHUTDOWN_TIMEOUT (1 s here) and the grace that ends the job left, and the client's stream ends
(it does not hang)."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from interfaces.controller_shutdown import END_GRACE
from ops.local_cluster import MODEL_NAME, AgentSpec, LocalCluster
from tests.e2e.clusters import MIB, get, local_cluster

pytestmark = pytest.mark.timeout(600)

#: The controller's SHUTDOWN_TIMEOUT in this cluster (s).
SHUTDOWN_TIMEOUT = 1.0
#: A request whose answer takes a while (the drain must have something to wait for).
LONG_ANSWER: dict[str, Any] = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}],
    "max_tokens": 200,
    "temperature": 0.8,
    "seed": 7,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    drain = ("--drain-timeout", "120")
    yield from local_cluster(
        tmp_path_factory.mktemp("graceful-stop"),
        AgentSpec("agent-a", 0, 1024 * MIB, holds_model=True, extra_args=drain),
        AgentSpec("agent-b", 0, 1024 * MIB, holds_model=True, extra_args=drain),
        AgentSpec("agent-c", 0, 1024 * MIB, holds_model=True, extra_args=drain),
        extra_env={"SHUTDOWN_TIMEOUT": str(SHUTDOWN_TIMEOUT)},
    )


class Stream:
    """A streamed chat completion read in a thread of its own."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.client = openai.OpenAI(
            base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0, timeout=300
        )
        self.chunks: list[Any] = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for chunk in self.client.chat.completions.create(stream=True, **LONG_ANSWER):
                self.chunks.append(chunk)
                if chunk.choices and chunk.choices[0].delta.content:
                    self.first.set()
        except BaseException as e:  # the test reads it
            self.error = e
        finally:
            self.first.set()

    @property
    def job_id(self) -> str:
        return str(uuid.UUID(self.chunks[0].id.removeprefix("chatcmpl-")))

    def text(self) -> str:
        return "".join(c.choices[0].delta.content or "" for c in self.chunks if c.choices)

    def finish_reason(self) -> str | None:
        reasons = [c.choices[0].finish_reason for c in self.chunks if c.choices]
        return reasons[-1] if reasons else None


def _node_names(cluster: LocalCluster) -> dict[str, str]:
    return {row["node_id"]: row["name"] for row in get(cluster, "/api/admin/nodes")["data"]}


def test_sigint_drains_the_agent_the_client_gets_its_whole_answer(cluster: LocalCluster) -> None:
    stream = Stream(cluster)
    assert stream.first.wait(120), "no token came"
    assert stream.error is None, stream.error
    job = get(cluster, f"/api/admin/jobs/{stream.job_id}")
    node_id = job["plan"]["primary"]["node_id"]
    name = _node_names(cluster)[node_id]
    agent = cluster.agent_procs[name].popen
    agent.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    stream.thread.join(180)
    assert not stream.thread.is_alive()
    assert stream.error is None, stream.error
    assert stream.finish_reason() in ("stop", "length")
    assert stream.text().strip()
    assert agent.wait(150) == 0
    print(f"the agent exited {time.monotonic() - signalled:.1f} s after SIGINT")

    assert get(cluster, f"/api/admin/jobs/{stream.job_id}")["state"] == "COMPLETED"
    events = get(cluster, f"/api/admin/nodes/{node_id}/events")["data"]
    codes = [e["code"] for e in events]
    assert "NODE_OFFLINE" not in codes
    stopping = codes.index("NODE_STOPPING")
    assert codes[-1] == "NODE_STOPPED" and stopping < len(codes) - 1
    assert stream.job_id in events[stopping]["payload"]["running_jobs"]
    stopped = events[-1]
    assert stopped["payload"]["lost_jobs"] == []
    assert stopped["summary"].startswith("stopped cleanly (drained (1 job(s) finished))")
    log = cluster.agent_procs[name].log.read_text(errors="replace")
    assert "SIGINT: draining: the agent stops once its 1 running job(s) end" in log


def test_a_second_sigint_stops_the_agent_at_once_and_its_job_is_lost(
    cluster: LocalCluster,
) -> None:
    stream = Stream(cluster)
    assert stream.first.wait(120), "no token came"
    node_id = get(cluster, f"/api/admin/jobs/{stream.job_id}")["plan"]["primary"]["node_id"]
    proc = cluster.agent_procs[_node_names(cluster)[node_id]]
    proc.popen.send_signal(signal.SIGINT)
    log = proc.log
    deadline = time.monotonic() + 30
    while "SIGINT: draining" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the agent did not start draining"
        time.sleep(0.05)
    proc.popen.send_signal(signal.SIGINT)
    assert proc.popen.wait(30) == 128 + signal.SIGINT
    stream.thread.join(60)
    assert not stream.thread.is_alive()
    assert isinstance(stream.error, openai.APIError)
    assert "stopped at once by a second signal (SIGINT)" in str(stream.error)
    assert get(cluster, f"/api/admin/jobs/{stream.job_id}")["state"] == "FAILED"
    events = get(cluster, f"/api/admin/nodes/{node_id}/events")["data"]
    assert [e["code"] for e in events][-1] == "NODE_STOPPED"
    assert events[-1]["payload"]["lost_jobs"] == [stream.job_id]


def test_sigterm_stops_the_controller_within_its_bound_with_a_log_line(
    cluster: LocalCluster,
) -> None:
    stream = Stream(cluster)
    assert stream.first.wait(120), "no token came"
    assert stream.error is None, stream.error
    controller = next(p for p in cluster.procs if p.name == "controller")
    controller.popen.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert controller.popen.wait(SHUTDOWN_TIMEOUT + 2 * END_GRACE + 10) == 0
    took = time.monotonic() - signalled
    stream.thread.join(30)
    assert not stream.thread.is_alive()  # its stream ended: whole, or with the stop's error
    log = controller.log.read_text(errors="replace")
    assert "SIGTERM: stopping: no new requests; waiting for 1 running job(s)" in log
    assert f"at most {SHUTDOWN_TIMEOUT:g} s (SHUTDOWN_TIMEOUT)" in log
    print(f"the controller exited 0 {took:.1f} s after SIGTERM")
    assert took < SHUTDOWN_TIMEOUT + 2 * END_GRACE + 5
