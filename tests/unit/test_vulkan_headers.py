"""Vulkan headers for the Vulkan backend (ops/vulkan_headers.py): whether the system's will do,
and the headers unpacked from a .deb without dpkg."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from ops import vulkan_headers
from ops.paths import FetchError


def include_dir(root: Path, core: str) -> Path:
    (root / "vulkan").mkdir(parents=True)
    (root / "vulkan" / "vulkan_core.h").write_text(core, encoding="utf-8")
    return root


def test_headers_with_layer_settings_suffice_older_ones_do_not(tmp_path: Path) -> None:
    new = include_dir(tmp_path / "new", "#define VK_EXT_layer_settings 1\n")
    old = include_dir(tmp_path / "old", "#define VK_HEADER_VERSION 239\n")
    assert vulkan_headers.system_headers_suffice([new])
    assert vulkan_headers.include_flags([new]) == ()
    assert not vulkan_headers.system_headers_suffice([old])
    assert not vulkan_headers.system_headers_suffice([tmp_path / "none"])
    [flag] = vulkan_headers.include_flags([old])
    assert flag == f"-DVulkan_INCLUDE_DIR={vulkan_headers.headers_dir()}"


def fake_deb(files: dict[str, bytes]) -> bytes:
    """A .deb as dpkg writes one: ar with debian-binary, control.tar.xz and data.tar.xz."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    out = bytearray(b"!<arch>\n")
    for name, content in (
        ("debian-binary", b"2.0\n"),
        ("control.tar.xz", b"x"),  # odd size: ar pads it
        ("data.tar.xz", data.getvalue()),
    ):
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}`\n"
        out += header.encode("ascii") + content + (b"\n" if len(content) % 2 else b"")
    return bytes(out)


def test_only_the_headers_are_unpacked_from_the_deb(tmp_path: Path) -> None:
    deb = fake_deb(
        {
            "./usr/include/vulkan/vulkan.hpp": b"// hpp",
            "./usr/include/vk_video/vulkan_video_codecs_common.h": b"// video",
            "./usr/lib/x86_64-linux-gnu/libvulkan.so": b"ELF",
            "./usr/share/doc/libvulkan-dev/copyright": b"text",
        }
    )
    assert set(vulkan_headers.ar_members(deb)) == {
        "debian-binary",
        "control.tar.xz",
        "data.tar.xz",
    }
    vulkan_headers.extract_headers(deb, tmp_path)
    assert (tmp_path / "vulkan" / "vulkan.hpp").read_bytes() == b"// hpp"
    assert (tmp_path / "vk_video" / "vulkan_video_codecs_common.h").is_file()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "vulkan.hpp",
        "vulkan_video_codecs_common.h",
    ]


def test_a_deb_without_headers_or_not_a_deb_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=r"no vulkan/vulkan\.hpp"):
        vulkan_headers.extract_headers(fake_deb({"./usr/share/doc/x": b"x"}), tmp_path)
    with pytest.raises(FetchError, match="not an ar archive"):
        vulkan_headers.extract_headers(b"PK\x03\x04", tmp_path)
