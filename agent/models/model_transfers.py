"""This node's model transfers: the file server other nodes fetch from, and the fetches the
controller asks for (``FetchModel``).

The node's certificate comes in ``Welcome`` (asked for in ``Hello``); with it the file server
(:mod:`common.model_file_server`) starts on the node's address and ``--transfer-port``, serving the
models whose sha256 the hash cache knows. A ``FetchModel`` runs in a thread of its own, trying
its sources in order (:mod:`agent.models.model_fetch`; ``--models-disk-limit`` caps what the models
directory may hold), and reports ``ModelTransfer`` STARTED, then
PROGRESS at each quarter, then COMPLETED or FAILED. A source that announces another size than
the model's, sends too slowly or takes too long (``--fetch-*``) is given up for the next one; a
URL source on a refused network (:mod:`common.model_sources`; ``allowed_source_cidrs`` in
``FetchModel`` widens it) is never connected to. A second ``FetchModel`` for a model being
fetched already is answered by the first one's reports. A ``ProbeLinks`` measures the links to
the peers it names (:mod:`agent.models.link_probe`) in a thread, with the same certificate, and
is answered by one ``LinkReport``.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from agent.models.fetch_limits import FetchLimits
from agent.models.link_probe import measure_links
from agent.models.model_fetch import DiskLimit, Source, TransferError, fetch
from agent.models.model_store import ModelStore
from agent.node.node_tls import NodeTls
from common.model_file_server import ModelFileServer
from common.model_sources import parse_cidrs
from common.transfer_ticket import CONTROLLER_SOURCE_ID
from wire import control_pb2 as pb

log = logging.getLogger(__name__)

Send = Callable[[pb.AgentMessage], Awaitable[None]]
#: Progress is reported at these fractions of the file.
STEPS = (0.25, 0.5, 0.75)


class ModelTransfers:
    def __init__(
        self,
        models_dir: Path,
        data_dir: Path,
        host: str,
        port: int,
        on_model_added: Callable[[], None],
        release: Callable[[Path], Awaitable[bool]] | None = None,
        controller_host: str = "",
        *,
        disk_limit: int | None = None,
        node_name: str = "",
        fetch_limits: FetchLimits | None = None,
    ) -> None:
        self.models_dir = models_dir
        #: How long one source may take (``--fetch-deadline``, ``--fetch-min-rate``,
        #: ``--fetch-rate-window``).
        self.fetch_limits = fetch_limits or FetchLimits()
        #: ``--models-disk-limit`` (None: only the disk's free space counts).
        self.disk_limit = DiskLimit(disk_limit, node_name) if disk_limit else None
        self.tls = NodeTls(data_dir)
        self.store = ModelStore(models_dir, data_dir, progress=None)
        self.host, self.port = host, port
        #: Where the controller's own model store is (the host this agent reaches it at).
        self.controller_host = controller_host
        #: Nodes revoked since their certificates were issued: refused by the file server.
        self.revoked: set[str] = set()
        self.on_model_added = on_model_added
        #: Lets a model file go (stops an idle llama-server that has it loaded); False while a
        #: job uses it. None: nothing here loads models.
        self.release = release
        self.server: ModelFileServer | None = None
        self.ca_pem = ""
        #: Fetches running now, by model sha256.
        self.fetching: set[str] = set()
        #: Held while links are measured (``ProbeLinks``).
        self._probing = asyncio.Lock()

    def csr(self, node_id: str) -> str:
        return self.tls.csr(node_id)

    def revoke(self, node_ids: Iterable[str]) -> None:
        """Nodes the file server refuses from now on, whatever tickets they hold."""
        self.revoked.update(node_ids)
        if self.server is not None:
            self.server.revoke(self.revoked)

    def welcomed(
        self, certificate_pem: str, ca_pem: str, revoked_node_ids: Iterable[str] = ()
    ) -> None:
        """Keeps the certificate the controller issued; starts the file server once."""
        self.revoke(revoked_node_ids)
        if not certificate_pem:
            log.warning("the controller issued no node certificate: no model files served")
            return
        self.tls.store(certificate_pem)
        self.ca_pem = ca_pem
        if self.server is None and self.port:
            try:
                self.server = ModelFileServer(
                    self.host, self.port, self.tls.server_context(ca_pem), ca_pem, self.resolve
                )
                self.server.revoke(self.revoked)
                self.server.start()
                log.info("serving model files on %s:%d", self.host, self.server.port)
            except OSError as e:
                log.warning("cannot serve model files on %s:%d: %s", self.host, self.port, e)

    def resolve(self, sha256: str) -> Path | None:
        """The file of a model this node holds, its hash known and unchanged (never hashed
        on a request)."""
        return self.store.cached_path(sha256)

    async def on_fetch(self, msg: pb.FetchModel, send: Send) -> None:
        if msg.model_sha256 in self.fetching:
            log.info("model %s is being fetched already", msg.file_name)
            return
        dest = self.models_dir / Path(msg.file_name).name
        if not self.tls.ready or not self.ca_pem:
            await send(_status(msg, pb.ModelTransfer.FAILED, 0, error="no node certificate"))
            return
        if self.store.cached_path(msg.model_sha256) is not None:  # fetched just before
            await send(_status(msg, pb.ModelTransfer.STARTED, 0))
            await send(_status(msg, pb.ModelTransfer.COMPLETED, msg.size_bytes))
            self.on_model_added()
            return
        try:
            allowed = parse_cidrs(msg.allowed_source_cidrs)
        except ValueError as e:
            await send(_status(msg, pb.ModelTransfer.FAILED, 0, error=str(e)))
            return
        self.fetching.add(msg.model_sha256)
        loop = asyncio.get_running_loop()
        reported = [0.0]

        def progress(held: int, size: int) -> None:
            for step in STEPS:
                if reported[0] < step <= held / max(size, 1):
                    reported[0] = step
                    message = _status(msg, pb.ModelTransfer.PROGRESS, held, size=size)
                    asyncio.run_coroutine_threadsafe(_sent(send, message), loop)

        try:
            await send(_status(msg, pb.ModelTransfer.STARTED, 0))
            error = ""
            source_id = ""
            for source in msg.sources:
                source_id = source.node_id or source.url
                host = source.host
                if source.node_id == CONTROLLER_SOURCE_ID and not host:
                    host = self.controller_host
                try:
                    await asyncio.to_thread(
                        fetch,
                        Source(source.node_id, host, source.port, source.ticket, source.url),
                        msg.model_sha256,
                        msg.size_bytes,
                        dest,
                        self.tls.client_context(self.ca_pem),
                        progress=progress,
                        limit=self.disk_limit,
                        limits=self.fetch_limits,
                        allowed=allowed,
                    )
                except TransferError as e:
                    error = str(e)
                    log.warning("fetching %s from %s failed: %s", dest.name, source_id, e)
                    if not e.retry:
                        break
                    continue
                except Exception as e:  # reported, never left hanging: jobs may wait for it
                    log.exception("fetching %s from %s failed", dest.name, source_id)
                    error = f"{type(e).__name__}: {e}"
                    continue
                await asyncio.to_thread(self.store.remember, dest, msg.model_sha256)
                self.on_model_added()
                done = _status(msg, pb.ModelTransfer.COMPLETED, msg.size_bytes, source_id)
                await send(done)
                return
            failed = _status(msg, pb.ModelTransfer.FAILED, 0, source_id, error or "no source")
            await send(failed)
        finally:
            self.fetching.discard(msg.model_sha256)

    async def on_probe_links(self, msg: pb.ProbeLinks, send: Send) -> None:
        """Measures the links to ``msg.peers`` one after another (in a thread); sends one
        ``LinkReport``, a measure per peer in their order."""
        context: ssl.SSLContext | None = None
        if self.tls.ready and self.ca_pem:
            try:
                context = self.tls.client_context(self.ca_pem)
            except (OSError, ValueError) as e:  # reported as no certificate, per peer
                log.warning("cannot use the node certificate to probe links: %s", e)
        peers = list(msg.peers)
        async with self._probing:  # one probe at a time: each bandwidth is its own
            report = await asyncio.to_thread(
                measure_links, msg.probe_id, peers, msg.probe_bytes, context
            )
        await send(pb.AgentMessage(link_report=report))

    async def on_evict(self, msg: pb.EvictModel, send: Send) -> None:
        """Deletes a model file, unless a job uses it or it is being fetched."""
        path = self.store.cached_path(msg.model_sha256)

        async def answer(ok: bool, error: str = "") -> None:
            evicted = pb.ModelEvicted(
                model_sha256=msg.model_sha256,
                ok=ok,
                file_name=path.name if path else "",
                error=error,
            )
            await send(pb.AgentMessage(model_evicted=evicted))

        if path is None:
            await answer(False, "this node does not hold that model")
            return
        if msg.model_sha256 in self.fetching:
            await answer(False, "the model is being fetched")
            return
        if self.release is not None and not await self.release(path):
            await answer(False, "a job uses the model now")
            return
        path.unlink()
        log.info("evicted model %s (%s)", path.name, msg.model_sha256[:12])
        self.on_model_added()  # the models changed: report them at once
        await answer(True)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


async def _sent(send: Send, message: pb.AgentMessage) -> None:
    await send(message)


def _status(
    msg: pb.FetchModel,
    state: int,
    done: int,
    source: str = "",
    error: str = "",
    *,
    size: int = 0,
) -> pb.AgentMessage:
    return pb.AgentMessage(
        model_transfer=pb.ModelTransfer(
            transfer_id=msg.transfer_id,
            model_sha256=msg.model_sha256,
            state=state,  # type: ignore[arg-type]
            bytes_done=done,
            size_bytes=size or msg.size_bytes,
            source_node_id=source,
            error=error,
        )
    )
