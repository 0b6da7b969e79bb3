"""node-agent flags for the runtime: --memory-limit, --models-disk-limit, --no-runtime,
--runtime-log-dir, --llama-backend, and build_handler's choice of handler."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.agent_config import AgentConfig, ConfigError, parse_byte_size
from agent.control.control_handler import NullHandler
from agent.handler_factory import RuntimeUnavailable, build_handler, resolve_binaries
from agent.main import build_parser, config_from_args
from agent.runtime.job_messages import TOKEN_BATCH_SECONDS
from agent.runtime.llama_handler import LlamaHandler
from agent.runtime.server_spec import DEFAULT_POLL
from common.contract import MEMORY_LIMIT_LABEL, SLOTS_LABEL, TRANSFER_PORT_LABEL


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1073741824", 1 << 30),
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("2g", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("64kb", 64 << 10),
        ("1T", 1 << 40),
        (" 8 MB ", 8 << 20),
    ],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "2Q", "-1G", "0", "1.5.2G", "2 G B"])
def test_bad_byte_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(text)


def config(tmp_path: Path, *flags: str) -> AgentConfig:
    args = build_parser().parse_args(["--data-dir", str(tmp_path / "data"), *flags])
    return config_from_args(args)


def test_memory_limit_is_an_inventory_label(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--memory-limit", "2G", "--slots", "3", "--label", "zone=a")
    assert cfg.memory_limit_bytes == 2 << 30
    assert cfg.inventory_labels() == {
        "zone": "a",
        SLOTS_LABEL: "3",
        MEMORY_LIMIT_LABEL: str(2 << 30),
        TRANSFER_PORT_LABEL: "50053",  # the model file server, on by default
    }
    assert MEMORY_LIMIT_LABEL not in config(tmp_path).inventory_labels()
    off = config(tmp_path, "--transfer-port", "0").inventory_labels()
    assert TRANSFER_PORT_LABEL not in off


def test_memory_limit_label_is_reserved(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--memory-limit"):
        config(tmp_path, "--label", f"{MEMORY_LIMIT_LABEL}=5")


def test_bad_memory_limit_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        config(tmp_path, "--memory-limit", "lots")
    assert caught.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_models_disk_limit_takes_a_size_from_the_flag_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MODELS_DISK_LIMIT", raising=False)
    assert config(tmp_path).models_disk_limit_bytes is None  # the disk is the limit
    assert config(tmp_path, "--models-disk-limit", "1.5T").models_disk_limit_bytes == 3 << 39
    assert config(tmp_path, "--models-disk-limit", "512M").models_disk_limit_bytes == 512 << 20
    assert config(tmp_path, "--models-disk-limit=1000").models_disk_limit_bytes == 1000
    monkeypatch.setenv("MODELS_DISK_LIMIT", "20G")
    assert config(tmp_path).models_disk_limit_bytes == 20 << 30
    assert config(tmp_path, "--models-disk-limit", "1G").models_disk_limit_bytes == 1 << 30


@pytest.mark.parametrize(
    ("flags", "env", "said"),
    [
        (["--models-disk-limit", "lots"], "", "not a size: 'lots'"),
        (["--models-disk-limit=-5G"], "", "not a size: '-5G'"),
        (["--models-disk-limit", "0"], "", "size must be at least 1 byte: '0'"),
        ([], "20 parsecs", "not a size: '20 parsecs'"),
    ],
)
def test_a_bad_models_disk_limit_exits_2_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    env: str,
    said: str,
) -> None:
    monkeypatch.setenv("MODELS_DISK_LIMIT", env)
    with pytest.raises(SystemExit) as caught:
        config(tmp_path, *flags)
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"node-agent: error: argument --models-disk-limit: {said}"
        + ("" if "at least" in said else " (use bytes or a K/M/G/T suffix, e.g. 2G)")
        + " (see --help)"
    )


def test_runtime_log_dir_defaults_under_the_data_dir(tmp_path: Path) -> None:
    assert config(tmp_path).resolved_runtime_log_dir == tmp_path / "data" / "logs"
    custom = config(tmp_path, "--runtime-log-dir", str(tmp_path / "l"))
    assert custom.resolved_runtime_log_dir == tmp_path / "l"


def test_no_runtime_gives_the_null_handler(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--no-runtime", "--llama-bin-dir", str(tmp_path / "nowhere"))
    assert not cfg.llama_runtime
    assert isinstance(build_handler(cfg), NullHandler)


def test_missing_binaries_are_a_config_error(tmp_path: Path) -> None:
    cfg = config(tmp_path, "--llama-bin-dir", str(tmp_path / "nowhere"))
    assert cfg.llama_runtime
    with pytest.raises(RuntimeUnavailable, match="nowhere") as caught:
        build_handler(cfg)
    assert "\n" not in str(caught.value) and isinstance(caught.value, ConfigError)


async def test_found_binaries_give_the_llama_handler(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("llama-server", "ggml-rpc-server"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    cfg = config(tmp_path, "--llama-bin-dir", str(bin_dir), "--slots", "2")
    handler = build_handler(cfg)
    assert isinstance(handler, LlamaHandler)
    assert handler.slots == 2 and handler.log_dir == tmp_path / "data" / "logs"
    assert handler.models_dir == tmp_path / "data" / "models"
    await handler.close()


async def test_threads_poll_and_the_stream_interval_reach_the_handler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--threads`` (env DACP_THREADS): llama.cpp's own default (every core) unless given;
    ``--poll`` (env DACP_POLL): llama-server's, 0 unless given; ``--stream-interval`` (env
    DACP_STREAM_INTERVAL): the pace of a job's token messages."""
    bin_dir = fake_build(tmp_path / "bin")
    monkeypatch.delenv("DACP_THREADS", raising=False)
    assert config(tmp_path).threads is None
    monkeypatch.setenv("DACP_THREADS", "3")
    assert config(tmp_path).threads == 3
    handler = build_handler(config(tmp_path, "--llama-bin-dir", str(bin_dir), "--threads", "1"))
    assert isinstance(handler, LlamaHandler)
    assert handler.server_threads == 1 and handler.rpc_host.rpc_threads == 1
    assert handler.server_poll == DEFAULT_POLL == 0
    await handler.close()
    monkeypatch.setenv("DACP_POLL", "30")
    assert config(tmp_path).poll == 30
    spinning = build_handler(config(tmp_path, "--llama-bin-dir", str(bin_dir), "--poll", "50"))
    assert isinstance(spinning, LlamaHandler) and spinning.server_poll == 50
    await spinning.close()
    monkeypatch.delenv("DACP_POLL")
    with pytest.raises(SystemExit) as refused:
        config(tmp_path, "--poll", "101")
    assert refused.value.code == 2
    assert "argument --poll: must be 0 to 100: '101'" in capsys.readouterr().err
    monkeypatch.delenv("DACP_STREAM_INTERVAL", raising=False)
    assert config(tmp_path).stream_interval == TOKEN_BATCH_SECONDS
    monkeypatch.setenv("DACP_STREAM_INTERVAL", "0.2")
    assert config(tmp_path).stream_interval == 0.2
    paced = build_handler(
        config(tmp_path, "--llama-bin-dir", str(bin_dir), "--stream-interval", "0")
    )
    assert isinstance(paced, LlamaHandler) and paced.stream_interval == 0.0
    await paced.close()
    monkeypatch.setenv("DACP_THREADS", "many")
    with pytest.raises(SystemExit) as caught:
        config(tmp_path)
    assert caught.value.code == 2
    assert "argument --threads: not an integer: 'many'" in capsys.readouterr().err


def test_the_default_advertised_address_is_the_one_the_controller_sees() -> None:
    """The controller checks at enrollment that the advertised address is the connection's
    source: by default the agent advertises the address of its route to the controller."""
    from agent.node.advertise_address import default_advertise_address

    assert default_advertise_address("127.0.0.1:50051") == "127.0.0.1"
    assert default_advertise_address("grpcs://127.0.0.1:50051") == "127.0.0.1"
    assert default_advertise_address("not a url:::") == default_advertise_address(None)


# --- --llama-backend: which llama.cpp build the agent runs -----------------------------------


def fake_build(directory: Path) -> Path:
    for name in ("llama-server", "ggml-rpc-server"):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text("#!/bin/sh\nexit 0\n")
        (directory / name).chmod(0o755)
    return directory


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DACP_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("DACP_LLAMA_BIN_DIR", "LLAMA_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache" / "llama.cpp"


def test_llama_backend_flag(tmp_path: Path) -> None:
    assert config(tmp_path).llama_backend == ""  # auto: $LLAMA_BACKEND, else the machine
    assert config(tmp_path, "--llama-backend", "cuda").llama_backend == "cuda"
    assert config(tmp_path, "--llama-backend", "auto").llama_backend == "auto"


def test_a_bad_llama_backend_flag_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        config(tmp_path, "--llama-backend", "rocm")
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--llama-backend" in err[0] and "'rocm'" in err[0]


def test_the_flag_picks_the_backends_cached_build(tmp_path: Path, cache: Path) -> None:
    fake_build(cache / "11434.0.0" / "bin")
    cuda = fake_build(cache / "11434.0.0-cuda" / "bin")
    found = resolve_binaries(config(tmp_path, "--llama-backend", "cuda"))
    assert (found.bin_dir, found.backend) == (cuda.resolve(), "cuda")


def test_a_missing_backend_build_is_one_line_naming_it(tmp_path: Path, cache: Path) -> None:
    fake_build(cache / "11434.0.0" / "bin")
    with pytest.raises(RuntimeUnavailable) as caught:
        resolve_binaries(config(tmp_path, "--llama-backend", "vulkan"))
    message = str(caught.value)
    assert "\n" not in message and "python -m ops.build_llama --backend vulkan" in message


def test_a_bad_llama_backend_variable_is_a_config_error(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLAMA_BACKEND", "rocm")
    with pytest.raises(RuntimeUnavailable) as caught:
        build_handler(config(tmp_path))
    assert str(caught.value) == (
        "llama.cpp runtime unavailable: $LLAMA_BACKEND='rocm' is not a llama.cpp backend; "
        "one of cpu, cuda, vulkan, metal, auto"
    )


def test_an_own_build_is_custom_unless_the_flag_names_its_backend(
    tmp_path: Path, cache: Path
) -> None:
    own = str(fake_build(tmp_path / "release-b9999"))
    assert resolve_binaries(config(tmp_path, "--llama-bin-dir", own)).backend == "custom"
    named = config(tmp_path, "--llama-bin-dir", own, "--llama-backend", "cuda")
    assert resolve_binaries(named).backend == "cuda"
