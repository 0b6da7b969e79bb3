"""Path ``cl`` of ``bench.compare_paths``: the emulated LAN's plumbing as commands and names
(no namespace is created here), the delay proxy on loopback, and how a skipped path reports."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.runtime.llama_binaries import RuntimeBinaries
from bench import compare_paths, delay_proxy, emulated_lan
from bench.compare_paths import PathRun, Sample
from bench.emulated_lan import LanUnavailable, LinkShape

# --- emulated_lan: what it would run ---------------------------------------------------------


def test_unavailable_reason_names_what_is_missing() -> None:
    assert "uid 1000" in (emulated_lan.unavailable_reason(euid=1000) or "")
    no_tc = emulated_lan.unavailable_reason(euid=0, which=lambda t: None if t == "tc" else t)
    assert no_tc is not None and "tc not found" in no_tc
    assert emulated_lan.unavailable_reason(euid=0, which=lambda tool: f"/sbin/{tool}") is None


def test_plan_links_takes_free_private_blocks_with_short_names() -> None:
    taken = [ipaddress.IPv4Network("10.99.0.0/17")]  # half the subnet is in use here
    links = emulated_lan.plan_links(2, 4194304, taken)
    assert [link.namespace for link in links] == ["dacp-lan-4194304-0", "dacp-lan-4194304-1"]
    for link in links:
        assert link.network.prefixlen == 30 and link.network.subnet_of(emulated_lan.SUBNET)
        assert not link.network.overlaps(taken[0])
        assert len(link.host_veth) <= 15 and len(link.peer_veth) <= 15
        assert link.host_veth != link.peer_veth
        assert link.peer_address == str(link.network.network_address + 2)
    assert links[0].network != links[1].network


def test_plan_links_refuses_when_the_subnet_is_in_use() -> None:
    with pytest.raises(LanUnavailable, match="no free /30"):
        emulated_lan.plan_links(1, 7, [ipaddress.IPv4Network("10.0.0.0/8")])


def test_setup_shapes_both_ends_and_teardown_deletes_both() -> None:
    (link,) = emulated_lan.plan_links(1, 42, [])
    shape = LinkShape(rate="1gbit")
    commands = emulated_lan.setup_commands(link, shape)
    assert commands[0] == ["ip", "netns", "add", link.namespace]
    tbf = ["tbf", "rate", "1gbit", "burst", "128kb", "latency", "10ms"]
    assert ["tc", "qdisc", "add", "dev", link.host_veth, "root", *tbf] in commands
    assert ["tc", "-n", link.namespace, "qdisc", "add", "dev", link.peer_veth, "root", *tbf] in (
        commands
    )
    # only the veth it creates gets an address: never a real interface
    for argv in commands:
        if "addr" in argv:
            assert argv[-1] in (link.host_veth, link.peer_veth)
    teardown = emulated_lan.teardown_commands(link)
    assert ["ip", "netns", "del", link.namespace] in teardown
    assert ["ip", "link", "del", link.host_veth] in teardown


def test_shape_describes_rate_and_delay() -> None:
    assert "+0.2 ms RTT" in LinkShape().describe() and "1gbit" in LinkShape().describe()
    assert "no added delay" in LinkShape(rtt_ms=0).describe()


def test_stale_namespaces_are_ours_with_a_dead_owner() -> None:
    listed = "dacp-lan-12-0 (id: 3)\ndacp-lan-99-1\nother-ns\ndacp-lan-x-0\ndacp-sw-1\n"
    names = emulated_lan.namespace_names(listed)
    assert names == ["dacp-lan-12-0", "dacp-lan-99-1", "other-ns", "dacp-lan-x-0", "dacp-sw-1"]
    assert emulated_lan.stale_namespaces(names, pid_alive=lambda pid: pid == 99) == [
        "dacp-lan-12-0"
    ]


def test_listening_ports_reads_proc_net_tcp() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue\n"
        "   0: 0100007F:C3A5 00000000:0000 0A 00000000:00000000\n"
        "   1: 0263630A:C3A4 00000000:0000 0A 00000000:00000000\n"
        "   2: 0100007F:C3A5 0100007F:9C40 01 00000000:00000000\n"
    )
    assert emulated_lan.listening_ports(text) == {50085, 50084}


def test_emulated_lan_raises_unavailable_before_touching_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(emulated_lan, "unavailable_reason", lambda: "needs root (test)")
    with (
        pytest.raises(LanUnavailable, match="needs root"),
        emulated_lan.EmulatedLan(2, LinkShape(), tmp_path),
    ):
        pass


# --- delay_proxy -----------------------------------------------------------------------------


@contextlib.contextmanager
def _echo_through_proxy(delay_s: float) -> Iterator[socket.socket]:
    """A client socket connected through a delay proxy to an echo server (all on loopback)."""
    echo = delay_proxy.listen("127.0.0.1", 0)
    proxy = delay_proxy.listen("127.0.0.1", 0)

    def serve_echo() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve_echo, daemon=True).start()
    target = ("127.0.0.1", int(echo.getsockname()[1]))
    threading.Thread(target=delay_proxy.serve, args=(proxy, target, delay_s), daemon=True).start()
    client = socket.create_connection(proxy.getsockname(), timeout=10)
    try:
        yield client
    finally:
        client.close()
        proxy.close()
        echo.close()


def _round_trip(client: socket.socket, payload: bytes) -> tuple[bytes, float]:
    start = time.perf_counter()
    client.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = client.recv(1 << 20)
        if not chunk:
            break
        received += chunk
    return received, time.perf_counter() - start


def test_delay_proxy_delays_each_way_and_keeps_the_bytes() -> None:
    with _echo_through_proxy(0.02) as client:
        payload = bytes(range(256)) * 4096  # 1 MiB, more than one chunk
        received, elapsed = _round_trip(client, payload)
        assert received == payload
        assert elapsed >= 0.04  # 20 ms there, 20 ms back
        received, elapsed = _round_trip(client, b"ping")
        assert received == b"ping" and 0.04 <= elapsed < 1.0


def test_delay_proxy_passes_a_close_on() -> None:
    with _echo_through_proxy(0.0) as client:
        client.sendall(b"bye")
        client.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := client.recv(64):
            received += chunk
        assert received == b"bye"  # the echo server saw the close and closed too


def test_wait_until_is_not_early() -> None:
    due = time.monotonic() + 0.002
    delay_proxy.wait_until(due)
    assert time.monotonic() >= due


def test_delay_proxy_rejects_a_bad_address() -> None:
    with pytest.raises(SystemExit):
        delay_proxy.main(["--listen", "nope", "--to", "127.0.0.1:1", "--delay-ms", "1"])


# --- compare_paths: path cl ------------------------------------------------------------------


_NO_RATIOS = {
    "machine": {},
    "settings": {"prompts": 1, "max_tokens": 16, "seed": 42, "order": "o", "quiet": 10.0},
    "comparisons": [],
}


def test_cl_is_a_default_path_compared_with_c() -> None:
    args = compare_paths.parse_args([])
    assert "cl" in args.path_keys
    assert args.lan_shape == LinkShape()
    assert ("cl", "c") in [(num, den) for num, den, _ in compare_paths.COMPARISONS]
    args = compare_paths.parse_args(
        ["--paths", "c,cl", "--lan-rtt-ms", "0", "--lan-rate", "100mbit"]
    )
    assert args.path_keys == ["c", "cl"]
    assert args.lan_shape == LinkShape(rate="100mbit", rtt_ms=0.0)
    with pytest.raises(SystemExit):
        compare_paths.parse_args(["--lan-rtt-ms", "-1"])


def test_cl_without_a_lan_is_skipped_not_failed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(emulated_lan, "unavailable_reason", lambda: "needs root (test)")
    run = PathRun("cl", compare_paths.LABELS["cl"])
    binaries = RuntimeBinaries(tmp_path, tmp_path / "llama-server", tmp_path / "rpc-server")
    with contextlib.ExitStack() as stack:
        compare_paths.start_direct(
            stack,
            run,
            binaries,
            tmp_path / "cl-direct",
            compare_paths.ServerSettings(tensor_split=(0.5, 0.5), rpc_count=2),
            rpc_workers=2,
            rpc_threads=None,
            lan=LinkShape(),
        )
    assert run.skipped == "no emulated LAN here: needs root (test)"
    assert run.failure is None and not run.usable
    assert (
        capsys.readouterr().out.strip() == "[cl] skipped: no emulated LAN here: needs root (test)"
    )

    c = PathRun("c", compare_paths.LABELS["c"])
    c.samples.append(Sample("c", 0, ttft_s=0.1, tokens_per_s=50.0, completion_tokens=16))
    runs = {"c": c, "cl": run}
    assert compare_paths.ran(runs, "c") and not compare_paths.ran(runs, "cl", "c")
    assert "[skipped]" in compare_paths.results_table([c, run])
    text = compare_paths.report(_NO_RATIOS, [c, run])
    assert "path cl skipped: no emulated LAN here: needs root (test)" in text
    assert "FAILED" not in text


def test_report_names_the_emulated_links() -> None:
    run = PathRun("cl", compare_paths.LABELS["cl"])
    run.details["lan"] = {
        "shape": LinkShape().describe(),
        "links": [{"worker": "10.99.0.2:50052"}, {"worker": "10.99.0.6:50052"}],
    }
    text = compare_paths.report(_NO_RATIOS, [run])
    assert "cl: RPC workers at 10.99.0.2:50052, 10.99.0.6:50052, tbf 1gbit" in text
