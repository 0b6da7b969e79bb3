"""agent.node.identity: the persisted node identity (identity.json)."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from agent.node.identity import (
    IDENTITY_FILE_NAME,
    IdentityFileError,
    NodeIdentity,
    delete_identity,
    identity_path,
    load_identity,
    save_identity,
)


def sample_identity() -> NodeIdentity:
    return NodeIdentity.new(
        node_id="3f0c5a1e-node",
        node_credential="s3cret-credential",
        controller_url="grpc://10.0.0.1:50051",
        node_name="gpu-box-1",
    )


def test_missing_identity_is_none(tmp_path: Path) -> None:
    assert load_identity(tmp_path) is None
    assert load_identity(tmp_path / "does-not-exist") is None


def test_round_trip_and_file_contents(tmp_path: Path) -> None:
    ident = sample_identity()
    path = save_identity(tmp_path / "data", ident)
    assert path == tmp_path / "data" / IDENTITY_FILE_NAME == identity_path(tmp_path / "data")
    assert load_identity(tmp_path / "data") == ident
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert set(raw) == {
        "node_id",
        "node_credential",
        "controller_url",
        "node_name",
        "enrolled_at",
        "controller_ca_pem",
        "tls_server_name",
    }
    assert raw["node_credential"] == "s3cret-credential"
    assert raw["enrolled_at"].endswith("+00:00")  # ISO 8601 UTC


def test_written_owner_only_and_no_temp_files_left(tmp_path: Path) -> None:
    path = save_identity(tmp_path, sample_identity())
    assert [p.name for p in tmp_path.iterdir()] == [IDENTITY_FILE_NAME]
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    else:  # Windows: permissions come from the user's profile ACL; the file is still written
        assert path.is_file()


def test_overwrite_replaces_atomically(tmp_path: Path) -> None:
    save_identity(tmp_path, sample_identity())
    moved = sample_identity().with_controller_url("grpcs://controller.lan:443")
    save_identity(tmp_path, moved)
    loaded = load_identity(tmp_path)
    assert loaded is not None and loaded.controller_url == "grpcs://controller.lan:443"
    assert [p.name for p in tmp_path.iterdir()] == [IDENTITY_FILE_NAME]


def test_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = sample_identity()
    save_identity(tmp_path, original)

    def failing_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        save_identity(tmp_path, original.with_controller_url("grpc://elsewhere:1"))
    monkeypatch.undo()
    assert load_identity(tmp_path) == original
    assert [p.name for p in tmp_path.iterdir()] == [IDENTITY_FILE_NAME]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"node_id": "n1"}',
        json.dumps(
            {
                "node_id": "",
                "node_credential": "c",
                "controller_url": "u",
                "node_name": "n",
                "enrolled_at": "t",
            }
        ),
        json.dumps(
            {
                "node_id": "n1",
                "node_credential": 5,
                "controller_url": "u",
                "node_name": "n",
                "enrolled_at": "t",
            }
        ),
    ],
    ids=["bad-json", "not-object", "missing-fields", "empty-id", "wrong-type"],
)
def test_unusable_file_raises(tmp_path: Path, content: str) -> None:
    (tmp_path / IDENTITY_FILE_NAME).write_text(content, encoding="utf-8")
    with pytest.raises(IdentityFileError, match=IDENTITY_FILE_NAME):
        load_identity(tmp_path)


def test_repr_hides_the_credential() -> None:
    ident = sample_identity()
    assert "s3cret" not in repr(ident)
    assert "s3cret" not in str(ident)
    assert "3f0c5a1e-node" in repr(ident)


def test_delete(tmp_path: Path) -> None:
    save_identity(tmp_path, sample_identity())
    assert delete_identity(tmp_path) is True
    assert load_identity(tmp_path) is None
    assert delete_identity(tmp_path) is False


def test_world_readable_file_is_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = save_identity(tmp_path, sample_identity())
    os.chmod(path, 0o644)
    caplog.set_level(logging.WARNING, logger="agent.node.identity")
    assert load_identity(tmp_path) is not None
    if os.name == "posix":
        assert "chmod 600" in caplog.text
    else:  # no POSIX permission bits to check
        assert "chmod 600" not in caplog.text
