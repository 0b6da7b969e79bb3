"""``dacp models add PATH`` and ``dacp models unstore NAME`` (interfaces/cli/store_cli.py) through
``interfaces.cli.main.main``, with DACP_VAR_DIR and MODEL_STORE_DIR under tmp_path and no
DATABASE_URL (SQLite in the var directory), on tiny GGUF files written with ``gguf``."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.persistence import PersistenceError

from application.controller import Controller
from domain.catalog import code_of
from domain.model import model_id
from infrastructure import model_store
from infrastructure.persistence import persistence_env
from interfaces.cli import cli_target
from interfaces.cli import main as cli
from tests.unit.fakes import FakeReadModel
from tests.unit.test_agent_model_store import write_tiny_gguf


@pytest.fixture
def var_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    var = tmp_path / "var"
    monkeypatch.setenv("DACP_VAR_DIR", str(var))
    monkeypatch.setenv("MODEL_STORE_DIR", str(tmp_path / "store"))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return var


@pytest.fixture
def store_dir(tmp_path: Path, var_dir: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    path = tmp_path / "files" / "tiny.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path, layers=4, context=1024)
    return path


class Stored:
    """The event store the commands wrote (SQLite under the var directory)."""

    def __init__(self, var_dir: Path) -> None:
        self.app = Controller(env=persistence_env(None, var_dir=var_dir))

    def codes(self, name: str) -> list[str]:
        return [code_of(e) for e in self.app.events.get(model_id(name))]

    def row(self, name: str) -> dict[str, Any] | None:
        return FakeReadModel(self.app).get_model(name)


#: Opens the event store afresh (after the CLI wrote and closed it).
OpenStore = Callable[[], Stored]


@pytest.fixture
def stored(var_dir: Path) -> Iterator[OpenStore]:
    opened: list[Stored] = []

    def open_store() -> Stored:
        opened.append(Stored(var_dir))
        return opened[-1]

    yield open_store
    for store in opened:
        store.app.close()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def store_files(store_dir: Path) -> list[str]:
    """The model files in the store (not the lists of names that use each)."""
    if not store_dir.exists():
        return []
    return sorted(p.name for p in store_dir.iterdir() if not p.name.endswith(".names"))


def add(*argv: str) -> int:
    return cli.main(["models", "add", *argv])


def unstore(name: str) -> int:
    return cli.main(["models", "unstore", name])


def test_add_copies_the_file_with_progress_and_registers_its_shape(
    gguf_file: Path,
    store_dir: Path,
    var_dir: Path,
    stored: OpenStore,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(model_store, "CHUNK", 1024)  # several chunks for the tiny file
    sha256 = sha256_of(gguf_file)
    size = gguf_file.stat().st_size
    assert size > 10 * 1024
    assert add(str(gguf_file)) == 0
    out, err = capsys.readouterr()
    *lines, used = err.splitlines()
    assert len(lines) >= 5
    assert all(line.startswith("copying tiny.gguf: ") for line in lines)
    assert used == f"dacp: used the event store SQLite in {var_dir} (DACP_VAR_DIR from environment)"
    percents = [int(re.findall(r"(\d+)%", line)[0]) for line in lines]
    assert percents == sorted(set(percents)) and percents[-1] == 100
    assert f"stored tiny.gguf ({size} bytes, sha256 {sha256[:12]}" in out
    assert "chat model tiny registered" in out
    assert store_files(store_dir) == [f"{sha256}.gguf"]
    assert (store_dir / f"{sha256}.gguf").read_bytes() == gguf_file.read_bytes()
    events = stored()
    assert events.codes("tiny") == ["MODEL_REGISTERED", "MODEL_STORED"]
    row = events.row("tiny")
    assert row is not None
    assert (row["sha256"], row["file_name"], row["kind"]) == (sha256, "tiny.gguf", "chat")
    assert row["context_size"] == 1024  # the model's own context, under the default 2048
    assert row["stored"] == {
        "size_bytes": size,
        "layers": 4,
        "context_length": 1024,
        "kv_bytes_per_token": 256,  # 4 layers * 2 KV heads * (8 + 8) dims * 2 bytes
        "architecture": "llama",
    }


def test_add_with_a_name_kind_and_context_and_again_records_nothing_more(
    gguf_file: Path, store_dir: Path, stored: OpenStore, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ("--name", "emb/e1", "--kind", "embedding", "--pooling", "mean")
    assert add(str(gguf_file), *argv, "--context-size", "512") == 0
    assert add(str(gguf_file), *argv, "--context-size", "512") == 0  # the same: one copy
    assert len(store_files(store_dir)) == 1
    events = stored()
    assert events.codes("emb/e1") == ["MODEL_REGISTERED", "MODEL_STORED"]
    row = events.row("emb/e1")
    assert row is not None
    assert (row["kind"], row["pooling"], row["context_size"]) == ("embedding", "mean", 512)
    assert "embedding model emb/e1 registered" in capsys.readouterr().out


def test_a_short_context_is_raised_to_the_minimum(
    tmp_path: Path, var_dir: Path, stored: OpenStore
) -> None:
    path = tmp_path / "short.gguf"
    write_tiny_gguf(path, context=64)
    assert add(str(path)) == 0
    row = stored().row("short")
    assert row is not None and row["context_size"] == 128
    assert row["stored"]["context_length"] == 64


def test_adding_another_file_under_the_same_name_updates_the_model(
    tmp_path: Path, store_dir: Path, stored: OpenStore, gguf_file: Path
) -> None:
    assert add(str(gguf_file), "--name", "m") == 0
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, layers=6, context=1024)
    assert add(str(other), "--name", "m") == 0
    events = stored()
    assert events.codes("m") == [
        "MODEL_REGISTERED",
        "MODEL_STORED",
        "MODEL_UPDATED",
        "MODEL_STORED",
    ]
    row = events.row("m")
    assert row is not None
    assert (row["sha256"], row["file_name"]) == (sha256_of(other), "other.gguf")
    assert row["stored"]["layers"] == 6


def test_a_file_that_is_not_gguf_exits_2_with_one_line(
    tmp_path: Path, store_dir: Path, var_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    assert add(str(bad)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("dacp: ")
    assert "bad.gguf" in err and "GGUF" in err
    assert store_files(store_dir) == []  # nothing copied
    assert add(str(tmp_path / "missing.gguf")) == 2
    assert capsys.readouterr().err.startswith("dacp: ")


def test_unstore_removes_the_file_and_records_model_unstored(
    gguf_file: Path, store_dir: Path, stored: OpenStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(str(gguf_file)) == 0
    capsys.readouterr()
    assert unstore("tiny") == 0
    assert "no longer in the controller's model store" in capsys.readouterr().out
    assert store_files(store_dir) == []
    events = stored()
    assert events.codes("tiny")[-1] == "MODEL_UNSTORED"
    row = events.row("tiny")
    assert row is not None and row["stored"] is None
    assert unstore("tiny") == 2  # not stored any more
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("dacp: cannot unstore tiny")
    assert unstore("unknown") == 2
    assert capsys.readouterr().err.startswith("dacp: cannot unstore unknown")


def test_unstore_of_a_file_already_gone_says_so(
    gguf_file: Path, store_dir: Path, stored: OpenStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(str(gguf_file)) == 0
    for path in store_dir.iterdir():
        path.unlink()
    capsys.readouterr()
    assert unstore("tiny") == 0
    assert "(its file was already gone)" in capsys.readouterr().out
    assert stored().codes("tiny")[-1] == "MODEL_UNSTORED"


def test_unstoring_one_of_two_models_of_one_file_keeps_the_file(
    gguf_file: Path, store_dir: Path, stored: OpenStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert add(str(gguf_file), "--name", "a") == 0
    assert add(str(gguf_file), "--name", "b") == 0
    assert unstore("a") == 0
    assert "its file stays: b use it" in capsys.readouterr().out
    row = stored().row("b")
    assert row is not None and row["stored"] is not None  # b still says the store holds it
    assert store_files(store_dir) == [f"{sha256_of(gguf_file)}.gguf"]
    assert unstore("b") == 0  # the last name lets it go
    assert store_files(store_dir) == []


def test_a_name_given_another_file_lets_the_old_one_go(
    gguf_file: Path, tmp_path: Path, store_dir: Path
) -> None:
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, layers=2)
    assert sha256_of(other) != sha256_of(gguf_file)
    assert add(str(gguf_file), "--name", "m") == 0
    assert add(str(other), "--name", "m") == 0
    assert store_files(store_dir) == [f"{sha256_of(other)}.gguf"]


def test_a_file_that_cannot_be_registered_is_refused_before_it_is_copied(
    tmp_path: Path, store_dir: Path, stored: OpenStore, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.bin"  # GGUF inside, but not a *.gguf file name
    write_tiny_gguf(path)
    assert add(str(path)) == 2
    [line] = capsys.readouterr().err.splitlines()  # no progress: nothing was copied
    assert line.startswith("dacp: cannot add ") and "*.gguf" in line
    assert store_files(store_dir) == []
    assert stored().codes("tiny") == []


def test_an_event_store_it_cannot_open_copies_nothing_and_says_so_in_one_line(
    gguf_file: Path,
    tmp_path: Path,
    store_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{blocker}/dacp.sqlite3")
    assert add(str(gguf_file), "--name", "m") == 2
    [line] = capsys.readouterr().err.splitlines()  # no progress: nothing was copied
    assert line.startswith("dacp: ") and str(blocker) in line
    assert store_files(store_dir) == []


def test_an_event_store_error_is_one_line_not_a_traceback(
    var_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def unreachable(args: object) -> object:
        raise PersistenceError("couldn't get a connection after 2.00 sec")

    monkeypatch.setattr(cli_target, "open_app", unreachable)
    assert unstore("m") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == "dacp: cannot use the event store: couldn't get a connection after 2.00 sec"
