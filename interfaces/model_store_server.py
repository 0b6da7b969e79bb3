"""The controller's model store, served to nodes: the same HTTPS file server nodes run
(:mod:`common.model_file_server`), with the controller's own certificate (named
``dacp-controller``, what fetchers verify it under), on ``MODEL_STORE_PORT`` of the gRPC host.
A fetch needs a ticket the controller signed for that node and model and the node's
certificate; revoked nodes are refused whatever they hold.

Only a controller with its own CA serves its store (it issues the node certificates and signs
the tickets); with the operator's TLS files, or none, nodes fetch from peers and URLs only.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable

from common.model_file_server import ModelFileServer, ServerLimits
from infrastructure.model_store import ControllerModelStore
from infrastructure.settings import Settings
from infrastructure.tls import ServerTls

log = logging.getLogger(__name__)


def start_store_server(
    settings: Settings, tls: ServerTls | None, revoked: Iterable[str]
) -> ModelFileServer | None:
    """Serves the model store, or None: it is off (MODEL_STORE_PORT=off) or cannot be."""
    if settings.model_store_port is None:
        return None
    if tls is None or tls.ca_key_pem is None:
        log.info("the model store is not served: this controller has no CA of its own")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=tls.ca_pem.decode())
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.chain_file, tls.key_file)
    context.verify_mode = ssl.CERT_REQUIRED
    store = ControllerModelStore(settings.model_store_dir)
    server = ModelFileServer(
        settings.grpc_host,
        settings.model_store_port,
        context,
        tls.ca_pem.decode(),
        store.resolve,
        ServerLimits(
            handshake_timeout=settings.model_store_handshake_timeout,
            workers=settings.model_store_workers,
            per_address=settings.model_store_connections_per_address,
        ),
    )
    server.revoke(revoked)
    server.start()
    log.info(
        "serving the model store %s on %s:%d", store.directory, settings.grpc_host, server.port
    )
    return server
