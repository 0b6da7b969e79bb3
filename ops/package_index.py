"""Download one pinned file from the package index, the way pip would find it, without pip.

``pip download`` of an sdist prepares the sdist's metadata, which installs (and with
``--no-binary :all:`` compiles) its build dependencies: on a fresh machine that cost ~20 minutes
before llama.cpp's own compile even started. Here the file's address is read from the index's
simple API (PEP 691 JSON, PEP 503 HTML as a fallback) and the file is streamed to disk while it
is hashed; nothing is built and nothing is installed.

The index comes from pip's own configuration, so a machine that points pip at a mirror
(``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, ``pip.conf``) is honoured: ``python -m pip config
list`` is asked once, environment variables win over files and ``download.*`` over
``global.*``, exactly pip's precedence. ``cert``/``PIP_CERT`` selects the CA bundle; proxies
come from the usual ``https_proxy`` variables (urllib reads them). Credentials in an index URL
(``https://USER:PASSWORD@host/simple``) are sent as HTTP Basic auth.

Standard library only: ``make`` runs this with the system Python before any venv exists.
"""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_INDEX_URL = "https://pypi.org/simple/"
_JSON_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, "
    "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
)
_CHUNK = 1 << 20
DEFAULT_TIMEOUT = 60.0
_USER_AGENT = "dacp-bootstrap (stdlib urllib)"


class PackageIndexError(RuntimeError):
    """The file could not be found or fetched; the message is one line."""


@dataclass(frozen=True)
class IndexConfig:
    """Where pip would look, and how it would connect."""

    index_urls: tuple[str, ...]
    cafile: str | None = None
    timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Located:
    url: str
    index_url: str


# --- pip's configuration ----------------------------------------------------------------


_CONFIG_LINE = re.compile(r"^(?P<scope>[^.]*)\.(?P<key>[A-Za-z0-9_-]+)=(?P<value>.*)$")
# Lower number wins: environment variables, then the download command's section, then global.
_SCOPE_RANK = {":env:": 0, "download": 1, "global": 2}


def parse_pip_config(listing: str) -> dict[str, str]:
    """``pip config list`` output → {key: value}, keeping the value pip itself would use."""
    best: dict[str, tuple[int, str]] = {}
    for raw in listing.splitlines():
        match = _CONFIG_LINE.match(raw.strip())
        if not match:
            continue
        rank = _SCOPE_RANK.get(match["scope"])
        if rank is None:
            continue
        value = match["value"]
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        key = match["key"].replace("_", "-")
        if key not in best or rank < best[key][0]:
            best[key] = (rank, value)
    return {key: value for key, (_, value) in best.items()}


def config_from(settings: Mapping[str, str]) -> IndexConfig:
    """The index list and connection settings from pip's merged configuration."""
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        raise PackageIndexError(
            "pip is configured with no-index; set PIP_INDEX_URL to a reachable index"
        )
    primary = settings.get("index-url") or DEFAULT_INDEX_URL
    extra = settings.get("extra-index-url", "").split()
    urls: list[str] = []
    for url in (primary, *extra):
        normal = url if url.endswith("/") else url + "/"
        if normal not in urls:
            urls.append(normal)
    timeout = DEFAULT_TIMEOUT
    try:
        timeout = max(float(settings.get("timeout") or settings.get("default-timeout") or 0), 0)
        timeout = timeout or DEFAULT_TIMEOUT
    except ValueError:
        timeout = DEFAULT_TIMEOUT
    return IndexConfig(tuple(urls), settings.get("cert") or None, timeout)


def pip_config(python: str = sys.executable) -> IndexConfig:
    """Ask pip (of ``python``) for its configuration; the default index when pip is absent."""
    try:
        result = subprocess.run(
            [python, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        listing = result.stdout if result.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    settings = parse_pip_config(listing)
    # `pip config list` shows PIP_* variables as ":env:" entries; read them directly as well in
    # case pip is missing, so the precedence holds either way.
    for name, key in (
        ("PIP_INDEX_URL", "index-url"),
        ("PIP_EXTRA_INDEX_URL", "extra-index-url"),
        ("PIP_CERT", "cert"),
        ("PIP_NO_INDEX", "no-index"),
        ("PIP_DEFAULT_TIMEOUT", "timeout"),
    ):
        if os.environ.get(name):
            settings[key] = os.environ[name]
    return config_from(settings)


# --- the simple API ---------------------------------------------------------------------


def normalize(project: str) -> str:
    """PEP 503 name normalisation."""
    return re.sub(r"[-_.]+", "-", project).lower()


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def files_in_page(body: bytes, content_type: str) -> list[tuple[str, str, dict[str, str]]]:
    """(filename, url-as-written, hashes) for each file a simple-API page lists."""
    if "json" in content_type:
        document: Any = json.loads(body)
        return [
            (str(f["filename"]), str(f["url"]), dict(f.get("hashes") or {}))
            for f in document.get("files", [])
        ]
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    found = []
    for href, text in parser.links:
        path, _, fragment = href.partition("#")
        name = text or urllib.parse.unquote(path.rsplit("/", 1)[-1])
        hashes = {}
        if "=" in fragment:
            algorithm, _, value = fragment.partition("=")
            hashes[algorithm] = value
        found.append((name, href, hashes))
    return found


def _split_credentials(url: str) -> tuple[str, dict[str, str]]:
    parts = urllib.parse.urlsplit(url)
    if not parts.username:
        return url, {}
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    clean = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return clean, {"Authorization": f"Basic {token}"}


def _context(config: IndexConfig) -> ssl.SSLContext:
    return (
        ssl.create_default_context(cafile=config.cafile)
        if config.cafile
        else (ssl.create_default_context())
    )


def _open(url: str, config: IndexConfig, accept: str | None = None) -> Any:
    clean, headers = _split_credentials(url)
    headers["User-Agent"] = _USER_AGENT
    if accept:
        headers["Accept"] = accept
    request = urllib.request.Request(clean, headers=headers)
    if clean.startswith("file:"):
        return urllib.request.urlopen(request, timeout=config.timeout)
    return urllib.request.urlopen(request, timeout=config.timeout, context=_context(config))


def _read_page(url: str, config: IndexConfig) -> tuple[bytes, str, str] | None:
    """(body, content type, final url) of a project page; None when the index lacks it."""
    if url.startswith("file:"):
        # A directory index on disk: pip reads <project>/index.html.
        local = urllib.request.url2pathname(urllib.parse.urlsplit(url).path)
        page = Path(local) / "index.html"
        if not page.is_file():
            return None
        return page.read_bytes(), "text/html", page.as_uri()
    try:
        with _open(url, config, _JSON_ACCEPT) as response:
            return response.read(), response.headers.get("Content-Type", ""), response.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise PackageIndexError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PackageIndexError(f"{_redact(url)}: {reason}") from exc


def _redact(url: str) -> str:
    return _split_credentials(url)[0]


def locate(project: str, file_name: str, sha256: str, config: IndexConfig) -> Located:
    """The address of ``file_name`` on the first configured index that lists it.

    A listing whose published sha256 differs from the pin is an error, not a fallback.
    """
    errors: list[str] = []
    for index_url in config.index_urls:
        page_url = urllib.parse.urljoin(index_url, normalize(project) + "/")
        try:
            page = _read_page(page_url, config)
        except PackageIndexError as exc:
            errors.append(str(exc))
            continue
        if page is None:
            continue
        body, content_type, final_url = page
        for name, href, hashes in files_in_page(body, content_type):
            if name != file_name:
                continue
            published = hashes.get("sha256")
            if published and published.lower() != sha256.lower():
                raise PackageIndexError(
                    f"{_redact(index_url)} lists {file_name} with sha256 {published}, "
                    f"not the pinned {sha256}"
                )
            absolute = urllib.parse.urljoin(final_url, href.partition("#")[0])
            return Located(absolute, index_url)
    where = ", ".join(_redact(url) for url in config.index_urls)
    detail = f" ({'; '.join(errors)})" if errors else ""
    raise PackageIndexError(f"{file_name} not found on {where}{detail}")


# --- download ---------------------------------------------------------------------------


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


class DownloadProgress:
    """Prints ``label  37%  12.0 MiB of 32.4 MiB  8.1 MiB/s`` every 10 % or 5 seconds (from
    the first second on)."""

    def __init__(self, label: str, emit: Callable[[str], None] = print) -> None:
        self.label = label
        self.emit = emit
        self.started = time.monotonic()
        self.last_print = self.started
        self.next_percent = 10

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        percent = 100 * done // total if total else None
        due = now - self.last_print >= 5.0
        if percent is not None and percent >= self.next_percent:
            self.next_percent = percent - percent % 10 + 10
            due = now - self.started >= 1.0  # a sub-second download gets only its summary
        if not due:
            return
        self.last_print = now
        rate = done / max(now - self.started, 1e-3)
        share = f"{percent:3d}%  " if percent is not None else ""
        of = f" of {human_bytes(total)}" if total else ""
        self.emit(f"  {self.label} {share}{human_bytes(done)}{of}  {human_bytes(rate)}/s")


def download(
    url: str,
    dest: Path,
    sha256: str,
    config: IndexConfig,
    progress: Callable[[int, int | None], None] | None = None,
) -> Path:
    """Stream ``url`` to ``dest`` through ``dest.part``, hashing as it goes.

    ``dest`` appears only complete and verified; a mismatch deletes the partial file.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    try:
        with _open(url, config) as response, partial.open("wb") as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        if digest.hexdigest() != sha256.lower():
            raise PackageIndexError(
                f"sha256 mismatch for {dest.name}: got {digest.hexdigest()}, expected {sha256}"
            )
        os.replace(partial, dest)
    except urllib.error.HTTPError as exc:
        raise PackageIndexError(
            f"downloading {_redact(url)}: HTTP {exc.code} {exc.reason}"
        ) from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PackageIndexError(f"downloading {_redact(url)}: {reason}") from exc
    finally:
        partial.unlink(missing_ok=True)
    return dest


def fetch(
    project: str,
    file_name: str,
    sha256: str,
    dest_dir: Path,
    *,
    config: IndexConfig | None = None,
    emit: Callable[[str], None] = print,
) -> Path:
    """``dest_dir/file_name``, downloaded from the index unless already there with the pin."""
    target = dest_dir / file_name
    if target.is_file() and _sha256(target) == sha256.lower():
        emit(f"  {file_name} already downloaded (sha256 ok)")
        return target
    config = config or pip_config()
    located = locate(project, file_name, sha256, config)
    emit(f"  downloading {file_name} from {_redact(located.index_url)}")
    started = time.monotonic()
    download(located.url, target, sha256, config, DownloadProgress(file_name, emit))
    size = target.stat().st_size
    seconds = time.monotonic() - started
    emit(f"  {file_name}: {human_bytes(size)} in {seconds:.1f} s, sha256 verified")
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
