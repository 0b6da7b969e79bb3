"""Fetches a model file from a node that holds it (:mod:`common.model_file_server`), into the models
directory, safely:

* it goes to ``<file>.partial`` and becomes ``<file>`` only once whole and its sha256 checked
  (so no partial file is ever where a complete one is expected);
* a cut transfer resumes from what ``.partial`` holds (an HTTP range), the bytes already there
  hashed again first;
* a wrong sha256 removes the partial file (the next attempt starts over);
* a file that does not fit the disk, or would take the models directory beyond
  ``--models-disk-limit`` (:class:`DiskLimit`), is refused before a byte is written, and a disk
  that fills meanwhile removes the partial file: a clear failure, nothing left behind;
* a source is given up for the next one (:mod:`agent.models.fetch_limits`) when its answer
  announces a size other than the model's, when it sends less than ``min_rate`` bytes a second over
  any ``rate_window`` (the TLS handshake and the answer's head included), and when it has not
  finished within ``deadline``: a peer that trickles a byte at a time cannot hold a fetch;
* a URL source (the operator's http(s) server) is checked after DNS resolution and reached at
  the very address checked (:mod:`agent.models.fetch_sources`, :mod:`common.model_sources`: not on
  loopback, link-local or a metadata address unless allowed), and what it answers besides the
  file is never read: a failure records its status code and a fixed description, never its
  body.

Blocking (it runs in a thread of its own): the bytes go socket → buffer → hash and file in
1 MiB pieces, so a LAN transfer is bound by the link.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import logging
import os
import queue
import shutil
import ssl
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agent.models.fetch_limits import FetchLimits, Watchdog
from agent.models.fetch_sources import (
    announced_size,
    connect_node,
    connect_url,
    describe,
    refusal_text,
)
from common.model_sources import Network, SourceRefused
from common.transfer_ticket import CONTROLLER_SOURCE_ID, MODELS_PATH

log = logging.getLogger(__name__)

CHUNK = 1 << 20
#: Pieces received ahead of the hashing and writing (CHUNK bytes each).
PIPELINE_BUFFERS = 4
#: Space a fetch leaves free on the models disk.
DISK_RESERVE_BYTES = 64 << 20
PARTIAL_SUFFIX = ".partial"

#: Called with (bytes held, total) as the file grows.
Progress = Callable[[int, int], None]


class TransferError(RuntimeError):
    """A fetch that failed; ``retry`` says whether another attempt (from the same or another
    source) may succeed."""

    def __init__(self, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass(frozen=True)
class Source:
    """A node that holds the model, and the ticket to fetch it there."""

    node_id: str
    host: str
    port: int
    ticket: str
    #: Instead of a node: an http(s) URL of the file (no ticket; system CAs for https).
    url: str = ""

    @property
    def label(self) -> str:
        if self.node_id == CONTROLLER_SOURCE_ID:
            return "the controller's model store"
        return self.url or f"node {self.node_id}"


def partial_path(dest: Path) -> Path:
    return dest.with_name(dest.name + PARTIAL_SUFFIX)


def _hash_existing(path: Path, hasher: hashlib._Hash) -> int:
    held = 0
    with path.open("rb", buffering=0) as existing:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while n := existing.readinto(buffer):
            hasher.update(view[:n])
            held += n
    return held


def _check_room(dest: Path, size: int, held: int) -> None:
    free = shutil.disk_usage(dest.parent).free
    needed = size - held
    if needed > free - DISK_RESERVE_BYTES:
        partial_path(dest).unlink(missing_ok=True)
        raise TransferError(
            f"{dest.name} needs {needed} more bytes; the models disk has {free} free "
            f"(keeping {DISK_RESERVE_BYTES} in reserve)",
            retry=False,
        )


def _readable(n: int) -> str:
    """``25165824 bytes (24.0 MiB)``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n} bytes ({n / (1 << shift):.1f} {unit})"
    return f"{n} bytes"


def models_room(models_dir: Path, limit_bytes: int | None) -> int:
    """What a new model file may take in ``models_dir`` now: the disk's free space less the
    reserve, and within ``limit_bytes`` (``--models-disk-limit``) when there is one."""
    models_dir.mkdir(parents=True, exist_ok=True)
    room = max(0, shutil.disk_usage(models_dir).free - DISK_RESERVE_BYTES)
    if limit_bytes:
        room = min(room, max(0, limit_bytes - DiskLimit(limit_bytes).used(models_dir)))
    return room


class DiskLimit:
    """``--models-disk-limit``: the most the ``*.gguf`` and ``.partial`` files directly in the
    models directory may hold. One per agent, shared by its fetches: a fetch under way counts
    at the size its file will have, so two at once cannot both take the last room."""

    def __init__(self, limit_bytes: int, node: str = "") -> None:
        self.limit_bytes = limit_bytes
        #: The node's name, for the hint in a refusal.
        self.node = node or "NODE"
        self._lock = threading.Lock()
        #: Fetches under way (between :meth:`reserve` and :meth:`release`): file → its size.
        self._growing: dict[Path, int] = {}

    def used(self, models_dir: Path, besides: Path | None = None) -> int:
        """What the model files in ``models_dir`` hold now (fetches under way at their whole
        size), ``besides`` and its partial file left out."""
        with self._lock:
            return self._used(models_dir, besides)

    def _used(self, models_dir: Path, besides: Path | None) -> int:
        growing = {
            dest: size
            for dest, size in self._growing.items()
            if dest.parent == models_dir and dest != besides
        }
        skipped = {path for dest in growing for path in (dest, partial_path(dest))}
        if besides is not None:
            skipped |= {besides, partial_path(besides)}
        total = sum(growing.values())
        try:
            children = list(models_dir.iterdir())
        except FileNotFoundError:
            return total
        for child in children:
            if child in skipped or not child.name.lower().endswith((".gguf", PARTIAL_SUFFIX)):
                continue
            try:
                status = child.stat()
            except OSError:  # gone meanwhile
                continue
            if stat.S_ISREG(status.st_mode):
                total += status.st_size
        return total

    def reserve(self, dest: Path, size: int) -> None:
        """Counts ``dest`` at ``size`` until :meth:`release`. Beyond the limit: removes its
        partial file and raises a TransferError no other source can cure."""
        with self._lock:
            used = self._used(dest.parent, dest)
            if used + size <= self.limit_bytes:
                self._growing[dest] = size
                return
        partial_path(dest).unlink(missing_ok=True)
        room = max(self.limit_bytes - used, 0)
        if size > self.limit_bytes:
            hint = "raise --models-disk-limit"
        else:
            hint = (
                f"make room (dacp models evict MODEL --node {self.node}) or raise "
                "--models-disk-limit"
            )
        raise TransferError(
            f"{dest.name} needs {_readable(size)}, beyond --models-disk-limit "
            f"{_readable(self.limit_bytes)}: the model files in {dest.parent} hold "
            f"{_readable(used)}, leaving {_readable(room)}; {hint}",
            retry=False,
        )

    def release(self, dest: Path) -> None:
        with self._lock:
            self._growing.pop(dest, None)


def _make_room(dest: Path, size: int, held: int, limit: DiskLimit | None) -> None:
    """Refuses (removing the partial file) a file beyond the limit or the disk's free space."""
    if limit is not None:
        limit.reserve(dest, size)
    _check_room(dest, size, held)


class _Resumed(TransferError):
    """The bytes held from an earlier attempt did not add up with this source's: they may
    have come from a source that lied. The partial file is gone; this source starts over."""


def fetch(
    source: Source,
    sha256: str,
    size: int,
    dest: Path,
    context: ssl.SSLContext,
    *,
    progress: Progress | None = None,
    timeout: float = 30.0,
    limit: DiskLimit | None = None,
    limits: FetchLimits | None = None,
    allowed: Sequence[Network] = (),
) -> Path:
    """Fetches the model into ``dest`` (resuming ``dest.partial``); returns ``dest``.
    ``size`` 0 means not known: the answer's length says (a URL source). ``timeout`` bounds
    each connect and read, ``limits`` the whole attempt; ``allowed``: networks a URL source
    may be on although :mod:`common.model_sources` refuses them."""
    dest = dest.absolute()
    limits = limits or FetchLimits()
    try:
        try:
            return _fetch(
                source, sha256, size, dest, context, progress, timeout, limit, limits, allowed
            )
        except _Resumed as e:
            log.warning("%s; fetching it from %s again from the start", e, source.label)
            return _fetch(
                source, sha256, size, dest, context, progress, timeout, limit, limits, allowed
            )
    finally:
        if limit is not None:
            limit.release(dest)


def _fetch(
    source: Source,
    sha256: str,
    size: int,
    dest: Path,
    context: ssl.SSLContext,
    progress: Progress | None,
    timeout: float,
    limit: DiskLimit | None,
    limits: FetchLimits,
    allowed: Sequence[Network],
) -> Path:
    partial = partial_path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    hasher = hashlib.sha256()
    held = _hash_existing(partial, hasher) if partial.exists() else 0
    if size and held > size:
        partial.unlink()
        hasher, held = hashlib.sha256(), 0
    if size:
        _make_room(dest, size, held, limit)
    started = time.monotonic()
    watch = Watchdog(limits)
    try:
        try:
            if source.url:
                connection, path = connect_url(source.url, timeout, allowed, watch)
                headers: dict[str, str] = {}
            else:
                connection = connect_node(
                    source.host, source.port, source.node_id, context, timeout, watch
                )
                path = MODELS_PATH + sha256
                headers = {"Authorization": f"Bearer {source.ticket}"}
        except SourceRefused as e:
            raise TransferError(str(e)) from e
        except (OSError, ValueError) as e:
            if watch.why is not None:
                raise TransferError(f"gave up on {source.label}: {watch.why}") from e
            where = source.url or f"{source.label} at {source.host}:{source.port}"
            raise TransferError(f"cannot reach {where}: {describe(e)}") from e
        try:
            if held:
                headers["Range"] = f"bytes={held}-"
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
            if response.status not in (200, 206):
                why = refusal_text(response, from_url=bool(source.url))
                raise TransferError(
                    f"{source.label} refused the transfer ({why})",
                    # Another source may hold the file, or answer once it is whole again.
                    retry=response.status >= 500 or response.status == 404,
                )
            if response.status == 200 and held:  # the range was not honoured: start over
                hasher, held = hashlib.sha256(), 0
            announced = announced_size(response, held)
            if announced is None:
                raise TransferError(f"{source.label} did not say how large {dest.name} is")
            if size and announced != size:
                raise TransferError(
                    f"{source.label} announced {dest.name} as {announced} bytes; the model's "
                    f"file is {size} bytes"
                )
            if not size:
                size = announced
                _make_room(dest, size, held, limit)
            resumed_from = held
            held = _receive(response, partial, held, size, hasher, progress, watch)
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                partial.unlink(missing_ok=True)
                why = f"the models disk filled up while fetching {dest.name}"
                raise TransferError(why, retry=False) from e
            if watch.why is not None:
                raise TransferError(f"gave up on {source.label}: {watch.why}") from e
            cut = f"transfer from {source.label} cut after {held} bytes: {describe(e)}"
            raise TransferError(cut) from e
        finally:
            watch.stop()  # before the close: the descriptor is not cut once reused
            connection.close()
    finally:
        watch.stop()
    if held != size or hasher.hexdigest() != sha256:
        partial.unlink(missing_ok=True)
        if held == size and resumed_from:
            raise _Resumed(f"{dest.name} does not match its sha256 with the bytes held before")
        raise TransferError(
            f"{dest.name} from {source.label} does not match its sha256 "
            f"({held} of {size} bytes); it is removed and fetched again"
        )
    os.replace(partial, dest)
    seconds = max(time.monotonic() - started, 1e-6)
    rate = size / seconds / 1e6
    log.info("fetched %s from %s: %d bytes at %.0f MB/s", dest.name, source.label, size, rate)
    return dest


class _Sink:
    """Hashes and writes the received pieces in a thread of its own, while the caller's thread
    receives the next ones: hashing and writing release the GIL, so a fetch is bound by the
    slowest of the three, not by their sum. Buffers go round a small pool; a write that fails
    stops the writing (the caller hears at its next piece), never the receiving thread's
    progress through the pool."""

    def __init__(self, out: IO[bytes], hasher: hashlib._Hash) -> None:
        self.out, self.hasher = out, hasher
        self.free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(PIPELINE_BUFFERS):
            self.free.put(bytearray(CHUNK))
        self.full: queue.SimpleQueue[tuple[bytearray, int] | None] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name="model-fetch-sink", daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while (item := self.full.get()) is not None:
            buffer, n = item
            if self.failure is None:
                try:
                    view = memoryview(buffer)[:n]
                    self.hasher.update(view)
                    while view:
                        view = view[self.out.write(view) or 0 :]
                except BaseException as e:  # handed to the receiving thread
                    self.failure = e
            self.free.put(buffer)

    def close(self) -> None:
        """Waits until every piece handed over is written; raises what writing raised."""
        self.full.put(None)
        self.thread.join()
        if self.failure is not None:
            raise self.failure


def _receive(
    response: http.client.HTTPResponse,
    partial: Path,
    held: int,
    size: int,
    hasher: hashlib._Hash,
    progress: Progress | None,
    watch: Watchdog,
) -> int:
    mode = "r+b" if held and partial.exists() else "wb"
    with partial.open(mode, buffering=0) as out:
        out.seek(held)
        out.truncate()
        sink = _Sink(out, hasher)
        try:
            read = watch.limits.read_size(CHUNK)
            while held < size and sink.failure is None:
                buffer = sink.free.get()
                n = response.readinto(memoryview(buffer)[:read])
                if not n:  # the source closed early (or was cut): what is held stays
                    sink.free.put(buffer)
                    raise http.client.IncompleteRead(b"", size - held)
                sink.full.put((buffer, n))
                held += n
                watch.received += n
                if progress is not None:
                    progress(held, size)
        finally:
            sink.close()  # what was received is on disk, even when receiving failed
        with contextlib.suppress(OSError):
            os.fsync(out.fileno())
    return held
