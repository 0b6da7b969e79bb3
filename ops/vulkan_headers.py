"""Vulkan headers new enough for this llama.cpp's Vulkan backend.

``ggml-vulkan.cpp`` (llama.cpp 11434) uses ``VK_EXT_layer_settings`` (``vk::LayerSettingEXT``),
which Debian 12's Vulkan headers (1.3.239) lack: the backend configures against them, then fails
to compile after the shaders are generated. Where the system's headers lack it, the build uses
Debian 13's ``libvulkan-dev`` headers (1.4.309) instead, fetched from deb.debian.org (a package
registry; pinned by sha256) and unpacked into the cache. Only the headers: the system's loader
(``libvulkan1``) and shader compiler (``glslc``) are used as they are.

A ``.deb`` is an ``ar`` archive holding ``data.tar.*``; it is read here without ``dpkg``.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from ops import paths
from ops.paths import FetchError

HEADERS_VERSION = "1.4.309"
DEB_URL = (
    "http://deb.debian.org/debian/pool/main/v/vulkan-loader/libvulkan-dev_1.4.309.0-1_amd64.deb"
)
DEB_SHA256 = "8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a"
#: What the backend needs from the headers (its first use that older headers lack).
NEEDED = "VK_EXT_layer_settings"
SYSTEM_INCLUDE_DIRS = (Path("/usr/include"), Path("/usr/local/include"))


def system_headers_suffice(roots: Iterable[Path] | None = None) -> bool:
    """The system's ``vulkan/vulkan_core.h`` has what the backend needs (no headers: False)."""
    for root in SYSTEM_INCLUDE_DIRS if roots is None else roots:
        core = root / "vulkan" / "vulkan_core.h"
        try:
            return NEEDED in core.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    return False


def headers_dir() -> Path:
    """Where the fetched headers go (an include directory: ``<it>/vulkan/vulkan.hpp``)."""
    return paths.cache_dir() / "vulkan-headers" / HEADERS_VERSION / "include"


def include_flags(roots: Iterable[Path] | None = None) -> tuple[str, ...]:
    """The CMake flag that points the build at the fetched headers, when the system's will not
    do (no I/O beyond reading the system's header)."""
    if system_headers_suffice(roots):
        return ()
    return (f"-DVulkan_INCLUDE_DIR={headers_dir()}",)


def ensure_headers() -> Path:
    """The fetched headers' include directory, fetching them first unless cached."""
    target = headers_dir()
    if (target / "vulkan" / "vulkan.hpp").is_file():
        return target
    print(f"fetching Vulkan headers {HEADERS_VERSION} (Debian 13 libvulkan-dev) ...", flush=True)
    data = _download(DEB_URL, DEB_SHA256)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    extract_headers(data, staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    print(f"Vulkan headers {HEADERS_VERSION} in {target}", flush=True)
    return target


def _download(url: str, sha256: str) -> bytes:
    started = time.monotonic()
    digest = hashlib.sha256()
    chunks: list[bytes] = []
    try:
        with urllib.request.urlopen(url, timeout=60) as response:  # a pinned URL
            total = int(response.headers.get("Content-Length") or 0)
            done = 0
            while chunk := response.read(1 << 18):
                chunks.append(chunk)
                digest.update(chunk)
                done += len(chunk)
                if total:
                    print(f"  {done * 100 // total:3d}% of {total >> 10} KiB", flush=True)
    except OSError as exc:
        raise FetchError(f"fetching {url}: {exc}") from exc
    if digest.hexdigest() != sha256:
        raise FetchError(f"{url} has sha256 {digest.hexdigest()}, expected {sha256}")
    print(f"  fetched in {time.monotonic() - started:.1f}s", flush=True)
    return b"".join(chunks)


def ar_members(archive: bytes) -> dict[str, bytes]:
    """The members of an ``ar`` archive (the format of a ``.deb``)."""
    if not archive.startswith(b"!<arch>\n"):
        raise FetchError("not an ar archive (a .deb starts with !<arch>)")
    members: dict[str, bytes] = {}
    offset = 8
    while offset + 60 <= len(archive):
        header = archive[offset : offset + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = offset + 60
        members[name] = archive[start : start + size]
        offset = start + size + (size & 1)
    return members


def extract_headers(deb: bytes, dest: Path) -> None:
    """Unpacks the ``usr/include`` of ``deb``'s data into ``dest`` (nothing else)."""
    data = next((v for k, v in ar_members(deb).items() if k.startswith("data.tar")), None)
    if data is None:
        raise FetchError("the .deb has no data.tar member")
    prefix = "./usr/include/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = []
        for member in tar.getmembers():
            name = member.name if member.name.startswith("./") else f"./{member.name}"
            if not name.startswith(prefix) or not (member.isfile() or member.isdir()):
                continue
            member.name = name[len(prefix) :]
            if member.name:
                members.append(member)
        tar.extractall(dest, members=members, filter="data")
    if not (dest / "vulkan" / "vulkan.hpp").is_file():
        raise FetchError("the .deb holds no vulkan/vulkan.hpp")
