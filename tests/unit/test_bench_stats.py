"""Statistics, formatting and log-parsing helpers of ``bench`` (no processes, no network)."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from bench import compare_paths, stats
from bench.compare_paths import PathRun, Sample

# --- percentile / summarize -----------------------------------------------------------------


def test_percentile_matches_linear_interpolation() -> None:
    values = [10.0, 20.0, 30.0, 40.0]
    assert stats.percentile(values, 0) == 10.0
    assert stats.percentile(values, 100) == 40.0
    assert stats.percentile(values, 50) == 25.0
    # rank 0.9 * 3 = 2.7 -> 30 + 0.7 * 10
    assert stats.percentile(values, 90) == pytest.approx(37.0)


def test_percentile_ignores_input_order_and_handles_one_value() -> None:
    assert stats.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert stats.percentile([7.5], 90) == 7.5


def test_percentile_of_ten_values_p90() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert stats.percentile(values, 90) == pytest.approx(9.1)
    assert stats.percentile(values, 50) == pytest.approx(5.5)


@pytest.mark.parametrize("q", [-1.0, 100.5, math.nan])
def test_percentile_rejects_bad_q(q: float) -> None:
    with pytest.raises(ValueError):
        stats.percentile([1.0], q)


def test_percentile_rejects_empty() -> None:
    with pytest.raises(ValueError):
        stats.percentile([], 50)


def test_summarize_skips_none() -> None:
    summary = stats.summarize([1.0, None, 3.0, 2.0])
    assert summary is not None
    assert summary.n == 3
    assert summary.median == 2.0
    assert summary.mean == 2.0
    assert (summary.min, summary.max) == (1.0, 3.0)
    assert summary.p90 == pytest.approx(2.8)
    assert summary.to_dict()["n"] == 3


def test_summarize_nothing() -> None:
    assert stats.summarize([]) is None
    assert stats.summarize([None, None]) is None


# --- ratios and pairs ------------------------------------------------------------------------


def test_ratio() -> None:
    assert stats.ratio(3.0, 2.0) == 1.5
    assert stats.ratio(None, 2.0) is None
    assert stats.ratio(1.0, None) is None
    assert stats.ratio(1.0, 0.0) is None


def test_paired_keeps_common_present_keys_in_key_order() -> None:
    num = {2: 4.0, 0: 1.0, 1: None, 5: 9.0}
    den = {0: 2.0, 1: 1.0, 2: 2.0, 3: 1.0}
    assert stats.paired(num, den) == [(1.0, 2.0), (4.0, 2.0)]


def test_paired_medians() -> None:
    pairs = [(2.0, 1.0), (3.0, 1.0), (10.0, 2.0), (1.0, 0.0)]
    # ratios 2, 3, 5 (the zero denominator is skipped)
    assert stats.paired_ratio_median(pairs) == 3.0
    # differences 1, 2, 8, 1 -> median 1.5
    assert stats.paired_difference_median(pairs) == 1.5
    assert stats.paired_ratio_median([]) is None
    assert stats.paired_difference_median([]) is None


# --- formatting ------------------------------------------------------------------------------


def test_fmt() -> None:
    assert stats.fmt(0.12345, 1, scale=1000) == "123.5"
    assert stats.fmt(12.0) == "12.0"
    assert stats.fmt(12) == "12"
    assert stats.fmt(None) == "-"
    assert stats.fmt(math.inf) == "-"
    assert stats.fmt_ratio(1.23456) == "1.235x"
    assert stats.fmt_ratio(None) == "-"


def test_format_table_aligns_columns() -> None:
    table = stats.format_table(["path", "ms"], [["a", "1.0"], ["b1", "123.4"]])
    assert table.splitlines() == [
        "path     ms",
        "----  -----",
        "a       1.0",
        "b1    123.4",
    ]


def test_format_table_custom_alignment_and_errors() -> None:
    table = stats.format_table(["x", "y"], [["1", "22"]], align="rl")
    assert table.splitlines()[2] == "1  22"
    with pytest.raises(ValueError):
        stats.format_table(["x", "y"], [["1"]])
    with pytest.raises(ValueError):
        stats.format_table(["x", "y"], [], align="lx")


@pytest.mark.parametrize(
    ("count", "text"),
    [(None, "-"), (512, "512 B"), (1536, "1.5 KiB"), (24 * 1024**3 + 1, "24.0 GiB")],
)
def test_human_bytes(count: int | None, text: str) -> None:
    assert stats.human_bytes(count) == text


def test_json_safe_replaces_non_finite_floats() -> None:
    data = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": (1, "x")}
    cleaned = stats.json_safe(data)
    assert cleaned == {"a": None, "b": [1.0, None, {"c": None}], "d": [1, "x"]}
    json.dumps(cleaned, allow_nan=False)


# --- compare_paths helpers -------------------------------------------------------------------


def test_tokens_per_second() -> None:
    assert compare_paths.tokens_per_second(64, 2.0) == 32.0
    assert compare_paths.tokens_per_second(None, 2.0) is None
    assert compare_paths.tokens_per_second(0, 2.0) is None
    assert compare_paths.tokens_per_second(64, 0.0) is None
    assert compare_paths.tokens_per_second(64, None) is None


def test_interleaved_order_alternates() -> None:
    keys = ["a", "b1", "c", "b2"]
    assert compare_paths.interleaved_order(keys, 0) == keys
    assert compare_paths.interleaved_order(keys, 1) == ["b2", "c", "b1", "a"]
    assert compare_paths.interleaved_order(keys, 2) == keys


def test_prompt_list_cycles_with_distinct_texts() -> None:
    prompts = compare_paths.prompt_list(len(compare_paths.PROMPTS) + 2)
    assert prompts[0] == compare_paths.PROMPTS[0]
    assert len(set(prompts)) == len(prompts)
    assert prompts[-1].endswith("(variant 2)")


def test_parse_start_lines() -> None:
    argv = ["/bin/llama-server", "--model", "/m/a b.gguf", "--ctx-size", "2048"]
    log = (
        "noise\n"
        f"=== 2026-01-01T00:00:00+00:00 starting: {shlex.join(argv)}\n"
        "load_tensors: ...\n"
        "=== 2026-01-01T00:01:00+00:00 starting: /bin/llama-server --port 1\n"
    )
    assert compare_paths.parse_start_lines(log) == [argv, ["/bin/llama-server", "--port", "1"]]
    assert compare_paths.parse_start_lines("nothing here") == []


def test_settings_from_argv_mirrors_runtime_spec() -> None:
    argv = (
        "/x/llama-server --model /m.gguf --ctx-size 2048 --host 127.0.0.1 --port 5 "
        "--parallel 2 --fit off --no-webui --log-verbosity 4 --threads 3 --poll 20 "
        "--alias smol --rpc 127.0.0.1:1,127.0.0.1:2 --n-gpu-layers 99 "
        "--tensor-split 0.25,0.75 --flash-attn on --no-mmap"
    ).split()
    settings = compare_paths.settings_from_argv(argv, source="log")
    assert settings == compare_paths.ServerSettings(
        ctx_size=2048,
        parallel=2,
        threads=3,
        poll=20,
        n_gpu_layers=99,
        tensor_split=(0.25, 0.75),
        rpc_count=2,
        extra_args=("--flash-attn", "on", "--no-mmap"),
        source="log",
    )


def test_settings_from_argv_defaults_and_short_flags() -> None:
    settings = compare_paths.settings_from_argv(["llama-server", "-c", "512", "-ngl", "0"], "s")
    assert settings.ctx_size == 512
    assert settings.n_gpu_layers == 0
    assert settings.parallel == 1
    assert settings.threads is None
    assert settings.poll == 0  # the agent's default, not llama.cpp's
    assert settings.tensor_split == ()
    assert settings.rpc_count == 0


def test_rpc_threads_from_argv() -> None:
    assert compare_paths.rpc_threads_from_argv(["rpc", "--host", "h", "--threads", "2"]) == 2
    assert compare_paths.rpc_threads_from_argv(["rpc", "--host", "h"]) is None


def test_mirrored_server_reads_the_newest_log(tmp_path: Path) -> None:
    logs = tmp_path / "agent-a" / "logs"
    logs.mkdir(parents=True)
    (logs / "llama-server.log").write_text(
        "=== t starting: /b/llama-server --ctx-size 1024\n"
        "=== t starting: /b/llama-server --ctx-size 2048 --rpc h:1,h:2 --tensor-split 0.5,0.5\n"
    )
    (logs / "rpc-worker-127.0.0.1-9.log").write_text(
        "=== t starting: /b/ggml-rpc-server --host 127.0.0.1 --port 9 --threads 1\n"
    )
    found = compare_paths.mirrored_server(tmp_path)
    assert found is not None
    settings, argv = found
    assert settings.ctx_size == 2048
    assert settings.tensor_split == (0.5, 0.5)
    assert argv[0] == "/b/llama-server"
    rpc = compare_paths.mirrored_rpc_threads(tmp_path)
    assert rpc is not None and rpc[0] == 1
    assert compare_paths.mirrored_server(tmp_path / "missing") is None


def test_cpu_model_from_cpuinfo() -> None:
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) CPU\n"
    assert compare_paths.cpu_model_from_cpuinfo(text) == "Intel(R) Xeon(R) CPU"
    assert compare_paths.cpu_model_from_cpuinfo("processor: 0\n") is None


def test_machine_line_mentions_cpu_cores_and_ram() -> None:
    line = compare_paths.machine_line(
        {
            "cpu_model": "TestCPU",
            "physical_cores": 2,
            "logical_cpus": 4,
            "virtualized": True,
            "ram_total_bytes": 8 * 1024**3,
            "os": "Linux",
            "python": "3.11",
            "llama_cpp": "1.0",
            "load_average_at_start": [0.1, 0.2, 0.3],
        }
    )
    assert "TestCPU (2 cores / 4 threads, VM)" in line
    assert "RAM 8.0 GiB" in line
    assert "llama.cpp 1.0," in line  # a run from before backends were recorded


def test_machine_line_names_the_llama_backend() -> None:
    machine = {"llama_cpp": "11434.0.0", "llama_backend": "cuda"}
    assert "llama.cpp 11434.0.0 (cuda backend)" in compare_paths.machine_line(machine)


def _run(key: str, values: list[tuple[float, float, str]]) -> PathRun:
    run = PathRun(key, key)
    for i, (ttft, tps, text) in enumerate(values):
        run.samples.append(
            Sample(key, i, ttft_s=ttft, tokens_per_s=tps, completion_tokens=64, text=text)
        )
    return run


def test_compare_and_tables() -> None:
    direct = _run("a", [(0.100, 50.0, "x"), (0.200, 40.0, "y"), (0.150, 45.0, "z")])
    ctrl = _run("b1", [(0.150, 45.0, "x"), (0.260, 36.0, "y"), (0.190, 40.5, "Z")])
    ctrl.samples.append(Sample("b1", 3, error="boom"))
    result = compare_paths.compare(ctrl, direct)
    assert result["ttft_ratio_of_medians"] == pytest.approx(0.190 / 0.150)
    assert result["ttft_overhead_ms_paired_median"] == pytest.approx(50.0)
    assert result["tokens_per_s_ratio_of_medians"] == pytest.approx(40.5 / 45.0)
    assert result["tokens_per_s_ratio_paired_median"] == pytest.approx(0.9)
    assert (result["identical_text"], result["compared_texts"], result["pairs"]) == (2, 3, 3)

    summary = ctrl.summary()
    assert (summary["ok"], summary["errors"]) == (3, 1)

    table = compare_paths.results_table([direct, ctrl])
    header, _rule, row_a, row_b1 = table.splitlines()
    assert "TTFT med ms" in header and "tok/s p90" in header
    assert row_a.split()[0] == "a" and "150.0" in row_a
    assert "3/4" in row_b1 and "190.0" in row_b1

    ratios = compare_paths.ratios_table([{**result, "meaning": "overhead"}])
    assert "b1/a" in ratios and "1.267x" in ratios and "2/3" in ratios
    assert result["server_prompt_ms_paired_difference"] is None  # no server timings


def test_compare_gives_the_servers_own_prompt_time_paired() -> None:
    """llama-server's prompt_ms on both paths: how much of the added TTFT is llama.cpp itself
    reading the prompt slower (CPU the controller's path took from it)."""
    direct = _run("a", [(0.100, 50.0, "x"), (0.200, 40.0, "y"), (0.150, 45.0, "z")])
    ctrl = _run("b1", [(0.150, 45.0, "x"), (0.260, 36.0, "y"), (0.190, 40.5, "z")])
    times: dict[str, tuple[float | None, ...]] = {"a": (60.0, 70.0, 65.0), "b1": (61.0, 73.0, None)}
    for run in (direct, ctrl):
        for sample, ms in zip(run.samples, times[run.key], strict=True):
            sample.server_prompt_ms = ms
    result = compare_paths.compare(ctrl, direct)
    assert result["server_prompt_ms_paired_difference"] == pytest.approx(2.0)  # of 1 and 3
    ratios = compare_paths.ratios_table([{**result, "meaning": "overhead"}])
    assert "of it prompt +ms" in ratios and "2.00" in ratios


def test_parse_args_quick_and_paths() -> None:
    args = compare_paths.parse_args(["--quick", "--paths", "c,a"])
    assert (args.prompts, args.max_tokens) == (3, 16)
    assert args.path_keys == ["a", "c"]
    args = compare_paths.parse_args([])
    assert (args.prompts, args.max_tokens, args.seed) == (
        30,
        64,
        42,
    )  # the issue asks for at least 30 paired prompts
    assert args.path_keys == ["a", "b1", "c", "cg", "cl", "b2"]
    with pytest.raises(SystemExit):
        compare_paths.parse_args(["--paths", "a,zz"])


def test_background_cpu_subtracts_our_process_tree() -> None:
    # the machine was busy 3.0 CPU-s, our processes 2.0 of them, over 1 s on 2 CPUs
    other, percent = compare_paths.background_cpu((10.0, 5.0), (13.0, 7.0), 1.0, 2)
    assert other == pytest.approx(1.0)
    assert percent == pytest.approx(50.0)
    # tick rounding can make ours exceed the machine's delta: clipped at zero
    assert compare_paths.background_cpu((0.0, 0.0), (0.01, 0.02), 1.0, 2) == (0.0, 0.0)
    assert compare_paths.background_cpu((0.0, 0.0), (1.0, 0.0), 0.0, 2)[1] is None


def test_cpu_meter_snapshot_is_monotonic() -> None:
    meter = compare_paths.CpuMeter()
    busy0, ours0 = meter.snapshot()
    sum(i * i for i in range(200_000))
    busy1, ours1 = meter.snapshot()
    assert busy1 >= busy0 and ours1 >= ours0
    assert meter.cpus >= 1


def test_compare_over_quiet_prompts_only() -> None:
    direct = _run("a", [(0.100, 50.0, "x"), (0.100, 50.0, "y"), (0.100, 50.0, "z")])
    ctrl = _run("b1", [(0.200, 25.0, "x"), (0.900, 5.0, "y"), (0.200, 25.0, "z")])
    for run in (direct, ctrl):
        for sample, background in zip(run.samples, (1.0, 60.0, 5.0), strict=True):
            sample.background_cpu_percent = background
    assert compare_paths.quiet_prompts([direct, ctrl], 10.0) == {0, 2}
    everything = compare_paths.compare(ctrl, direct)
    quiet = compare_paths.compare(ctrl, direct, max_background=10.0)
    assert everything["pairs"] == 3 and quiet["pairs"] == 2
    assert quiet["ttft_ratio_of_medians"] == pytest.approx(2.0)
    assert quiet["tokens_per_s_ratio_paired_median"] == pytest.approx(0.5)
    assert quiet["ttft_overhead_ms_paired_median"] == pytest.approx(100.0)
    assert compare_paths.compare(ctrl, direct, max_background=0.5)["pairs"] == 0
