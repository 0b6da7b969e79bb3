"""ops.gpu_check's pure parts: memory limits that make the real planner choose the tiers the
check expects, the plan check, replaying an agent's command lines, reading a stream, the
verdicts and the exit status. The whole check is rehearsed by hand (README, 'Checking on a
GPU'): it takes minutes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agent.runtime.llama_backend import CPU, CUDA
from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.placement import (
    DEFAULT_DEVICE_RESERVE_BYTES,
    GIB,
    MIB,
    Candidate,
    Device,
    ModelNeeds,
    PlacementRequest,
)
from domain.split_planner import plan_placement
from ops import gpu_check
from ops.gpu_check import Steps, memory_limits, plan_problem
from ops.gpu_measure import Comparison, PlanView, Run, Sample, StreamReader

NEEDS = ModelNeeds(
    name="random-llama-1.01b",
    sha256="a" * 64,
    file_name="random.gguf",
    weights_bytes=2_013_000_000,
    layers=12,
    kv_bytes_per_token=98_304,
    context_length_max=8192,
)
CONTEXT = 2048


def _plan(backend: str, limits: list[int]) -> PlanView:
    """What the real planner makes of agents on one 80 GiB GPU offering ``limits``."""
    gpu = 80 * GIB
    candidates = [
        Candidate(
            node_id=f"node-{i}",
            name=f"agent-{i}",
            state="READY",
            address="10.0.0.5",
            rpc_port=50052 + i,
            usable_memory_bytes=limit,
            free_slots=4,
            has_model=i == 0,
            heartbeat_fresh=True,
            slot_cap=4,
            devices=(Device("CUDA0", min(gpu, limit)),) if backend != CPU else (),
        )
        for i, limit in enumerate(limits)
    ]
    result = plan_placement(
        PlacementRequest(NEEDS, CONTEXT, DEFAULT_ALLOWED_PEER_CIDRS), candidates
    )
    assert result.plan is not None, result.no_capacity
    return PlanView.from_plan(result.plan.to_dict())


@pytest.mark.parametrize("backend", [CUDA, CPU])
def test_the_limits_make_the_planner_choose_one_device_then_a_split_over_both(
    backend: str,
) -> None:
    required = PlacementRequest(NEEDS, CONTEXT, DEFAULT_ALLOWED_PEER_CIDRS).required_bytes
    solo, split = memory_limits(required, backend)
    one, two = _plan(backend, [solo]), _plan(backend, list(split))
    assert plan_problem(one, backend, 1) is None, one
    assert plan_problem(two, backend, 2) is None, two
    if backend == CUDA:
        assert (one.tier, one.devices) == ("one_device", ("CUDA0",))
        assert (two.tier, two.devices) == ("gpus_over_rpc", ("CUDA0", "CUDA0 via RPC"))
    else:
        assert (one.tier, one.nodes, two.tier, two.nodes) == ("cpu", 1, "cpu_over_rpc", 2)


def test_a_gpu_keeps_its_compute_reserve_beyond_its_share() -> None:
    solo, (primary, worker) = memory_limits(1000 * MIB, CUDA)
    share = DEFAULT_DEVICE_RESERVE_BYTES + math.ceil(gpu_check.PRIMARY_SHARE * 1000 * MIB)
    assert primary == share
    assert worker == DEFAULT_DEVICE_RESERVE_BYTES + math.ceil(gpu_check.WORKER_SHARE * 1000 * MIB)
    assert solo == gpu_check.SOLO_FACTOR * (1000 * MIB + DEFAULT_DEVICE_RESERVE_BYTES)
    assert memory_limits(1000 * MIB, CPU) == (4000 * MIB, (250 * MIB, 850 * MIB))


def test_a_plan_that_is_not_the_expected_one_is_named() -> None:
    host = PlanView(tier="gpus_and_host", nodes=1, devices=("CUDA0",), parallel=1)
    assert plan_problem(host, CUDA, 2) == "tier gpus_and_host instead of gpus_over_rpc; " + (
        "1 node(s) instead of 2; devices CUDA0"
    )
    two_local = PlanView(tier="gpus_over_rpc", nodes=2, devices=("CUDA0", "CUDA1"), parallel=1)
    assert plan_problem(two_local, CUDA, 2) == "devices CUDA0, CUDA1"
    assert plan_problem(PlanView("cpu", 2, (), 1), CPU, 1) == "2 node(s) instead of 1"


def test_the_last_run_of_a_log_gives_the_command_line() -> None:
    log = (
        "\n=== 2026-12-05T07:00:00+00:00 starting: /bin/llama-server --port 1\nloading\n"
        "\n=== 2026-12-05T07:01:00+00:00 starting: /bin/llama-server --model '/a b.gguf' "
        "--port 2\nready\n"
    )
    expected = ["/bin/llama-server", "--model", "/a b.gguf", "--port", "2"]
    assert gpu_check.last_start_argv(log) == expected
    assert gpu_check.last_start_argv("no runs here") is None


def test_a_replayed_command_line_differs_only_in_binary_address_and_workers() -> None:
    recorded = [
        "/agent/bin/llama-server",
        "--model",
        "/m.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "4000",
        "--rpc",
        "127.0.0.1:5000",
        "--device",
        "CUDA0,RPC0",
        "--tensor-split",
        "0.4,0.6",
    ]
    argv = gpu_check.replay_argv(
        recorded, binary="/bin/llama-server", host="127.0.0.1", port=9, rpc=["127.0.0.1:7"]
    )
    replaced = ["9", "--rpc", "127.0.0.1:7"]
    assert argv == ["/bin/llama-server", *recorded[1:6], *replaced, *recorded[9:]]
    bare = gpu_check.replay_argv(["/x", "--model", "/m.gguf"], binary="/y", host="h", port=3)
    assert bare == ["/y", "--model", "/m.gguf", "--host", "h", "--port", "3"]


def test_each_rpc_worker_the_primary_names_is_found_in_its_agents_log(tmp_path: Path) -> None:
    for agent, port, device in (("agent-a", 5001, "CPU"), ("agent-b", 5002, "CUDA0")):
        logs = tmp_path / agent / "logs"
        logs.mkdir(parents=True)
        (logs / f"rpc-worker-127.0.0.1-{port}.log").write_text(
            f"\n=== t starting: /bin/ggml-rpc-server --host 127.0.0.1 --port {port} "
            f"--device {device}\n"
        )
    primary = ["/bin/llama-server", "--rpc", "127.0.0.1:5002,127.0.0.1:5001"]
    workers = gpu_check.worker_argvs(tmp_path, primary)
    assert [gpu_check.flag_value(w, "--device") for w in workers] == ["CUDA0", "CPU"]
    with pytest.raises(gpu_check.CheckError, match="rpc-worker"):
        gpu_check.worker_argvs(tmp_path, ["/bin/llama-server", "--rpc", "127.0.0.1:6000"])


def _chunk(content: str | None = None, usage: int | None = None) -> str:
    import json

    data: dict[str, object] = {"choices": [{"delta": {"content": content}}] if content else []}
    if usage is not None:
        data["usage"] = {"completion_tokens": usage, "prompt_tokens": 5}
    return "data: " + json.dumps(data)


def test_a_stream_gives_time_to_first_token_and_decode_rate() -> None:
    reader = StreamReader(started=10.0)
    lines = [
        (_chunk("", None), 10.01),  # the role chunk: no content yet
        (_chunk("Hello", None), 10.05),
        ("", 10.05),
        (_chunk(" world", None), 10.15),
        (_chunk("!", None), 10.25),
        (_chunk(None, 3), 10.26),
        ("data: [DONE]", 10.27),
    ]
    assert [reader.line(text, now) for text, now in lines] == [True] * 6 + [False]
    sample = reader.sample("direct", 0, ended=10.3)
    assert sample.error is None
    assert sample.ttft_s == pytest.approx(0.05)
    assert sample.tokens_per_s == pytest.approx(3 / 0.2)
    assert (sample.completion_tokens, sample.content_chunks, sample.text) == (
        3,
        3,
        "Hello world!",
    )


def test_a_stream_without_usage_or_content_or_with_an_error_is_an_error() -> None:
    no_usage = StreamReader(0.0)
    no_usage.line(_chunk("a"), 0.1)
    assert "usage" in (no_usage.sample("r", 0, 1.0).error or "")
    empty = StreamReader(0.0)
    empty.line(_chunk(None, 0), 0.1)
    assert empty.sample("r", 0, 1.0).error == "the stream carried no content"
    failed = StreamReader(0.0)
    assert failed.line('data: {"error": {"message": "out of memory"}}', 0.1) is False
    assert "out of memory" in (failed.sample("r", 0, 1.0).error or "")


def _run(key: str, pairs: list[tuple[float, float]]) -> Run:
    """A run whose request i took ``pairs[i]`` = (tokens/s, TTFT in seconds)."""
    run = Run(key)
    for i, (rate, ttft) in enumerate(pairs):
        run.samples.append(Sample(key, i, ttft_s=ttft, tokens_per_s=rate, completion_tokens=8))
    return run


def test_verdicts_hold_at_the_thresholds_and_fail_beyond_them() -> None:
    direct = _run("direct", [(100.0, 0.010), (100.0, 0.020), (100.0, 0.030)])
    close = _run("one-agent", [(97.0, 0.0149), (97.0, 0.0249), (97.0, 0.0349)])
    comparison = Comparison.of(close, direct)
    assert comparison.decode_ratio == pytest.approx(0.97)
    assert comparison.added_ttft_ms == pytest.approx(4.9)
    assert [met for _, met in comparison.verdicts()] == [True, True]
    slow = _run("one-agent", [(96.0, 0.0151), (96.0, 0.0251), (96.0, 0.0351)])
    assert [met for _, met in Comparison.of(slow, direct).verdicts()] == [False, False]


def _result(backend: str) -> dict[str, object]:
    return {
        "started_at": "2026-12-05T08:00:00+00:00",
        "gpus": ["NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"] if backend == CUDA else [],
        "cpus": 16,
        "llama_cpp": "11434.0.0",
        "model": {"name": "random-llama-1.01b", "params": 1_006_684_160, "bytes": 2 << 30},
        "settings": {"requests": 3, "max_tokens": 128},
        "steps": {"build": 300.0, "measure": 20.0},
    }


def _runs(controller_rate: float) -> list[Run]:
    direct = [(100.0, 0.010)] * 3
    through = [(controller_rate, 0.012)] * 3
    return [
        _run("direct", direct),
        _run("one-agent", through),
        _run("direct-rpc", direct),
        _run("two-agents", through),
    ]


def test_a_gpu_check_fails_when_a_goal_is_not_met_and_a_cpu_rehearsal_does_not() -> None:
    text, passed = gpu_check.report(_result(CUDA), _runs(99.0), CUDA)
    assert passed, text
    assert "PASS  one-agent: decode 0.990x of direct (>= 0.97x)" in text
    assert "NVIDIA H100 80GB HBM3" in text
    assert "total 320s, within the 9-minute budget" in text
    text, passed = gpu_check.report(_result(CUDA), _runs(90.0), CUDA)
    assert not passed
    assert "FAILED: goal not met: two-agents: decode 0.900x of direct (>= 0.97x)" in text
    text, passed = gpu_check.report(_result(CPU), _runs(90.0), CPU)
    assert passed, text
    assert "not judged on cpu" in text


def test_a_wrong_plan_or_a_failed_request_fails_the_check() -> None:
    runs = _runs(100.0)
    runs[3].plan_problem = "tier cpu instead of gpus_over_rpc"
    runs[0].samples.append(Sample("direct", 3, error="HTTP 503: busy"))
    text, passed = gpu_check.report(_result(CUDA), runs, CUDA)
    assert not passed
    assert "FAILED: direct: 1 request(s) failed" in text
    assert "FAILED: two-agents: wrong plan: tier cpu instead of gpus_over_rpc" in text


def test_steps_are_announced_with_the_elapsed_time_and_timed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    now = [100.0]
    steps = Steps(2, clock=lambda: now[0])
    steps.begin(1, "build", "building")
    now[0] = 175.0
    steps.begin(2, "model", "writing")
    now[0] = 180.5
    steps.end()
    assert steps.durations == {"build": 75.0, "model": 5.5}
    assert capsys.readouterr().out.splitlines() == ["[1/2 +0:00] building", "[2/2 +1:15] writing"]


def test_a_missing_payload_is_named_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(gpu_check.CheckError, match=r"python -m ops\.gpu_payload"):
        gpu_check.preflight(tmp_path)


def test_arguments_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    args = gpu_check.parse_args(["--backend", "cpu", "--params", "5e7"])
    assert (args.backend, args.params, args.requests) == ("cpu", 5e7, gpu_check.DEFAULT_REQUESTS)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--max-tokens", "1"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--backend", "vulkan"])
    capsys.readouterr()


def test_a_failed_stage_marks_the_runs_it_did_not_warm_up_and_the_check_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    controller, direct = Run("two-agents"), Run("direct-rpc")

    def set_up() -> None:
        controller.warmup = Sample("two-agents", -1, ttft_s=0.1)
        raise gpu_check.CheckError("direct-rpc: llama-server exited with code 1\nits log")

    gpu_check.stage([controller, direct], set_up)
    assert (controller.usable, controller.failure) == (True, None)
    assert direct.failure == "direct-rpc: llama-server exited with code 1"
    assert not direct.usable

    def broken() -> None:
        raise KeyError("plan")

    other = Run("one-agent")
    gpu_check.stage([other], broken)
    assert other.failure == "KeyError: 'plan'"
    assert "FAILED: KeyError: 'plan'" in capsys.readouterr().out


def _payload(tmp_path: Path) -> Path:
    from ops import gpu_payload, paths

    for name in (paths.LLAMA_SDIST_FILE_NAME, gpu_payload.TOKENIZER_FILE):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_the_preflight_imports_the_runtime_here(tmp_path: Path) -> None:
    gpu_check.preflight(_payload(tmp_path))  # this venv has every runtime package


def test_a_package_the_runtime_lacks_is_named_before_the_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "RUNTIME_MODULES", (*gpu_check.RUNTIME_MODULES, "no_such"))
    with pytest.raises(gpu_check.CheckError, match="No module named 'no_such'") as caught:
        gpu_check.preflight(_payload(tmp_path))
    assert "\n" not in str(caught.value)
