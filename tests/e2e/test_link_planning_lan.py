"""The split planner over a LAN the test builds: a worker behind a fast link is taken before a
roomier one behind a slow link, and a split over a link slower than ``MIN_SPLIT_LINK_MBPS`` is
refused, naming that link (docs/request-flow.md, '3. Scheduling', rule 5).

The LAN exists only inside the test: a "switch" network namespace holding a Linux bridge, and
three node namespaces joined to it by veth pairs, each with a private address on a /24 of the
test's own: the primary P (it holds the model file), the fast worker F and the slow worker S.
This namespace joins the bridge by one more veth pair, on which the controller (TLS on, so it
signs the probes' tickets; the embedded SQLite store) listens for the agents' control channels.
tbf shapes both ends of F's veth to 1 Gbit/s and both ends of S's to 100 Mbit/s. No delay is
added (the kernel has no netem): a round trip is the bridge's own, plus tbf's queue while the
link is busy.

Real agents (llama.cpp, the SmolLM2 test model) run in P, F and S, each with its model file
server. Their memory limits make P unable to hold the model alone, while P with either worker
can; S offers more than F, so without links the planner's "roomiest worker" rule would take S:
only the measured links make it take F.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import openai
import pytest

from ops import artifacts
from ops.local_cluster import MODEL_NAME, AgentSpec, ClusterConfig, LocalCluster, _Proc
from tests.dacp_cli import stop_process
from tests.e2e.clusters import MIB, admin, get
from tests.security.netns import ip

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PRIMARY, FAST, SLOW = "lan-primary", "lan-fast", "lan-slow"
#: P alone cannot hold SmolLM2-135M (≈216 MiB with one slot); P with either worker can. S
#: offers more than F: the roomiest worker, were the links not measured.
MEMORY = {PRIMARY: 160 * MIB, FAST: 160 * MIB, SLOW: 200 * MIB}
FAST_RATE, SLOW_RATE, SLOWER_RATE = "1gbit", "100mbit", "5mbit"
#: The controller's floor: S's link is above it until the last test slows it, even measured
#: while another node downloads its own probe from S (every node probes at once: S's 100 Mbit/s
#: measure from 40 to 100).
MIN_SPLIT_LINK_MBPS = 20.0

T = TypeVar("T")


def tc(*args: str) -> None:
    """``tc ARGS``, which must succeed within 10 seconds."""
    subprocess.run(["tc", *args], check=True, capture_output=True, timeout=10)


@dataclass(frozen=True)
class LanNode:
    """A node's namespace on the LAN: ``device`` (its end of the veth, in ``namespace``) has
    ``address``; ``port`` is the bridge's end, in the switch namespace."""

    namespace: str
    address: str
    device: str
    port: str


@dataclass
class Lan:
    """A bridge in the ``switch`` namespace, the ``nodes`` (by agent name) joined to it, and
    this namespace joined to it with ``gateway`` (the controller's address)."""

    switch: str
    gateway: str
    nodes: dict[str, LanNode]

    @classmethod
    @contextlib.contextmanager
    def create(cls, names: tuple[str, ...]) -> Iterator[Lan]:
        tag = uuid.uuid4().hex[:6]
        net = f"10.78.{int(tag[:2], 16)}"
        lan = cls(f"dacp-sw-{tag}", f"{net}.1", {})
        root_link = f"lr{tag}"
        try:
            ip("netns", "add", lan.switch)
            ip("-n", lan.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", lan.switch, "link", "set", "br0", "up")
            ip("link", "add", root_link, "type", "veth", "peer", "name", f"ls{tag}")
            lan._plug(f"ls{tag}")
            ip("addr", "add", f"{lan.gateway}/24", "dev", root_link)
            ip("link", "set", root_link, "up")
            for i, name in enumerate(names):
                node = LanNode(f"dacp-n{i}-{tag}", f"{net}.{11 + i}", f"n{i}n{tag}", f"n{i}b{tag}")
                lan.nodes[name] = node
                ip("netns", "add", node.namespace)
                ip("link", "add", node.device, "type", "veth", "peer", "name", node.port)
                lan._plug(node.port)
                ip("link", "set", node.device, "netns", node.namespace)
                ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.device)
                ip("-n", node.namespace, "link", "set", node.device, "up")
                ip("-n", node.namespace, "link", "set", "lo", "up")
            yield lan
        finally:
            subprocess.run(["ip", "link", "del", root_link], capture_output=True, check=False)
            for namespace in [*(n.namespace for n in lan.nodes.values()), lan.switch]:
                _end_processes_in(namespace)
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)

    def _plug(self, port: str) -> None:
        """Moves ``port`` (a veth end in this namespace) onto the switch's bridge."""
        ip("link", "set", port, "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")

    def shape(self, name: str, rate: str) -> None:
        """Both ends of the node's veth send at most ``rate`` (tbf): to it and from it."""
        node = self.nodes[name]
        for namespace, device in ((node.namespace, node.device), (self.switch, node.port)):
            tc(
                *("-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf"),
                *("rate", rate, "burst", "256kb", "latency", "20ms"),
            )


def _end_processes_in(namespace: str) -> None:
    """SIGKILL whatever this test started that still runs in ``namespace`` (after the agents
    were stopped, nothing should)."""
    found = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
    )
    for pid in found.stdout.split():
        subprocess.run(["kill", "-KILL", pid], capture_output=True, check=False)


class LanCluster(LocalCluster):
    """A local cluster whose agents run in the LAN's node namespaces: each reaches the
    controller at the LAN's gateway and advertises its own address there."""

    def __init__(self, config: ClusterConfig, lan: Lan) -> None:
        super().__init__(config)
        self.lan = lan

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> _Proc:
        node = self.lan.nodes.get(name)
        if node is not None:  # an agent: the later flags win over the local cluster's
            where = ("--controller-url", f"{self.lan.gateway}:{self.grpc_port}")
            inside = ["ip", "netns", "exec", node.namespace]
            argv = [*inside, *argv, *where, "--advertise-address", node.address]
        return super()._spawn(name, argv, env)


@pytest.fixture(scope="module")
def lan() -> Iterator[Lan]:
    with Lan.create((PRIMARY, FAST, SLOW)) as made:
        made.shape(FAST, FAST_RATE)
        made.shape(SLOW, SLOW_RATE)
        yield made


@pytest.fixture(scope="module")
def cluster(lan: Lan, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    artifacts.ensure_llama()
    artifacts.ensure_model()
    config = ClusterConfig(
        var_dir=tmp_path_factory.mktemp("lan-cluster"),
        port=0,
        grpc_port=0,
        agents=tuple(
            AgentSpec(name, 0, memory_limit=MEMORY[name], holds_model=name == PRIMARY)
            for name in (PRIMARY, FAST, SLOW)
        ),
        quiet=True,
        extra_env={
            "GRPC_HOST": lan.gateway,
            # The last test waits for a link measured again after it slows S's.
            "LINK_PROBE_INTERVAL": "15",
            "MIN_SPLIT_LINK_MBPS": f"{MIN_SPLIT_LINK_MBPS:g}",
        },
    )
    with LanCluster(config, lan) as running:
        yield running


def eventually(what: str, probe: Callable[[], T | None], seconds: float) -> T:
    """``probe()``'s first true value, polled until ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        value = probe()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {seconds:g} s"
        time.sleep(0.5)


def nodes_by_name(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in get(cluster, "/api/admin/nodes")["data"]}


def link(cluster: LocalCluster, prober: str, peer: str) -> dict[str, Any] | None:
    """What ``prober`` last measured of its link to ``peer`` (None: not yet)."""
    rows = nodes_by_name(cluster)
    measured: dict[str, Any] | None = (rows[prober].get("links") or {}).get(rows[peer]["node_id"])
    return measured


def measured_links(cluster: LocalCluster) -> tuple[dict[str, Any], dict[str, Any]]:
    """P's links to F and to S, once it measured both."""

    def both() -> tuple[dict[str, Any], dict[str, Any]] | None:
        fast, slow = link(cluster, PRIMARY, FAST), link(cluster, PRIMARY, SLOW)
        return (fast, slow) if fast and slow else None

    return eventually("measure of P's links to F and S", both, 120)


def test_the_primary_measures_the_fast_link_faster_than_the_slow_one(
    cluster: LocalCluster,
) -> None:
    fast, slow = measured_links(cluster)
    print(f"P→F {fast}\nP→S {slow}")
    assert fast["error"] == "" and slow["error"] == ""
    assert fast["mbps"] > 300, fast
    assert 0 < slow["mbps"] < 150, slow
    assert fast["rtt_ms"] > 0 and slow["rtt_ms"] > 0
    assert fast["measured_at"] and slow["measured_at"]


def job_id_of(completion_id: str) -> str:
    return str(uuid.UUID(completion_id.removeprefix("chatcmpl-")))


def test_the_split_takes_the_worker_behind_the_fast_link(cluster: LocalCluster) -> None:
    measured_links(cluster)
    rows = nodes_by_name(cluster)
    # S's link is above the floor both ways: S is passed over for being slower, not too slow.
    to_slow = [link(cluster, PRIMARY, SLOW), link(cluster, SLOW, PRIMARY)]
    assert all(m["mbps"] >= MIN_SPLIT_LINK_MBPS for m in to_slow if m), to_slow
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key, max_retries=0)
    asked: list[Any] = [{"role": "user", "content": "Name three colours of the rainbow."}]
    stream = api.chat.completions.create(
        model=MODEL_NAME, messages=asked, stream=True, max_tokens=16, temperature=0
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), "the stream answered nothing"
    path = f"/api/admin/jobs/{job_id_of(chunks[0].id)}"

    def completed() -> dict[str, Any] | None:
        job: dict[str, Any] = get(cluster, path)
        return job if job["state"] == "COMPLETED" else None

    plan = eventually("job COMPLETED", completed, 30)["plan"]
    print(f"plan: {plan['tier']}, reasons: {plan['reasons']}")
    assert plan["primary"]["node_id"] == rows[PRIMARY]["node_id"]
    # S is the roomier worker: only the measured links make the planner take F.
    assert [w["node_id"] for w in plan["workers"]] == [rows[FAST]["node_id"]], plan


def test_a_split_over_a_link_below_the_floor_is_refused_naming_it(
    cluster: LocalCluster, lan: Lan
) -> None:
    """F gone and S's link slowed below MIN_SPLIT_LINK_MBPS: only P with S would hold the
    model, and the refusal names that link."""
    stop_process(cluster.agent_procs[FAST].popen, signal.SIGINT, 30)
    lan.shape(SLOW, SLOWER_RATE)

    def slowed() -> bool:
        measures = [link(cluster, PRIMARY, SLOW), link(cluster, SLOW, PRIMARY)]
        return any(m and not m["error"] and m["mbps"] < MIN_SPLIT_LINK_MBPS for m in measures)

    eventually("measure of S's slowed link", slowed, 120)
    eventually("F disconnected", lambda: not nodes_by_name(cluster)[FAST]["connected"], 60)
    print(f"P→S {link(cluster, PRIMARY, SLOW)}\nS→P {link(cluster, SLOW, PRIMARY)}")
    refused = httpx.post(
        f"{cluster.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {cluster.ai_api_key}"},
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
        timeout=120,
    )
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "no_capacity", error
    message = error["message"]
    assert f"MIN_SPLIT_LINK_MBPS={MIN_SPLIT_LINK_MBPS:g}" in message, message
    assert f"{PRIMARY} to {SLOW} (" in message, message
    [job] = httpx.get(
        f"{cluster.url}/api/admin/jobs?limit=1", headers=admin(cluster), timeout=10
    ).json()["data"]
    assert job["state"] == "FAILED" and job["error_code"] == "no_capacity", job
    assert message.endswith(job["failure"]["reason"]), job
