"""Model transfer tickets: what lets one node download a model file from another.

The controller signs a ticket with its CA's key; it names the model (sha256), the node that may
fetch it, and when it expires. A serving node checks it with the CA certificate it pinned at
enrollment, and checks that the client certificate of the connection is that node's (the
controller's CA issues every node its certificate). A revoked node gets no more tickets.

Format: ``base64url(JSON claims) "." base64url(ECDSA-SHA256 signature of the first part)``.
Shared by the controller (signs) and the agents (verify): part of the wire contract.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from common.contract import CONTROLLER_TLS_NAME

#: How long a ticket lets a download start (a started download may run longer).
TICKET_TTL_SECONDS = 300.0
#: The path a serving node answers: ``/models/<sha256>``.
MODELS_PATH = "/models/"
#: The name in a node's certificate: ``dacp-node-<node id>`` (fetchers verify it).
NODE_TLS_NAME_PREFIX = "dacp-node-"
#: A transfer source that is the controller's own model store, not a node (it serves with the
#: controller's certificate: ``common.contract.CONTROLLER_TLS_NAME``).
CONTROLLER_SOURCE_ID = "controller"


class TicketError(ValueError):
    """A ticket that does not let anyone in; the message says why."""


@dataclass(frozen=True)
class Ticket:
    sha256: str
    node_id: str
    expires_at: float


def node_tls_name(node_id: str) -> str:
    return NODE_TLS_NAME_PREFIX + node_id


def source_tls_name(source_id: str) -> str:
    """The name a fetcher expects in the certificate of a source (a node or the controller)."""
    return CONTROLLER_TLS_NAME if source_id == CONTROLLER_SOURCE_ID else node_tls_name(source_id)


def peer_node_id(peer_cert: dict[str, object] | None) -> str | None:
    """The node id in a verified client certificate (``ssl.getpeercert()``), if any."""
    if not peer_cert:
        return None
    for rdn in peer_cert.get("subject", ()):  # type: ignore[attr-defined]
        for key, value in rdn:
            if (
                key == "commonName"
                and isinstance(value, str)
                and value.startswith(NODE_TLS_NAME_PREFIX)
            ):
                return value.removeprefix(NODE_TLS_NAME_PREFIX)
    return None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_ticket(ca_key_pem: bytes, ticket: Ticket) -> str:
    key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TicketError("the controller's CA key is not an EC key")
    claims = {"sha256": ticket.sha256, "node": ticket.node_id, "exp": ticket.expires_at}
    body = _b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
    signature = key.sign(body.encode(), ec.ECDSA(hashes.SHA256()))
    return f"{body}.{_b64(signature)}"


def verify_ticket(text: str, ca_pem: bytes, now: float) -> Ticket:
    """The ticket's claims, when the CA signed it and it has not expired."""
    try:
        body, signature = text.split(".")
        public = x509.load_pem_x509_certificate(ca_pem).public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey):
            raise TicketError("the pinned CA has no EC key")
        public.verify(_unb64(signature), body.encode(), ec.ECDSA(hashes.SHA256()))
        claims = json.loads(_unb64(body))
        ticket = Ticket(str(claims["sha256"]), str(claims["node"]), float(claims["exp"]))
    except TicketError:
        raise
    except (ValueError, KeyError, TypeError, InvalidSignature, binascii.Error) as e:
        raise TicketError(f"not a ticket the controller signed ({type(e).__name__})") from None
    if ticket.expires_at < now:
        raise TicketError("the ticket has expired")
    return ticket
