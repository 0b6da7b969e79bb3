"""Pinning the controller's certificate authority at enrollment.

An enrollment token carries the sha256 fingerprint of the controller's CA (its ``ca`` claim).
Before enrolling, the agent opens one TLS connection to the controller without verifying it,
takes from the chain the controller presents the certificate whose fingerprint is the token's,
and from then on verifies the controller against that certificate alone (gRPC's normal
verification, with the pinned CA as the only root). Nothing is copied by hand, and a
controller that cannot show the pinned CA (a man in the middle, a wrong address) is refused.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from cryptography import x509

from agent.agent_config import AgentError
from proto import CONTROLLER_TLS_NAME


class TlsPinMismatch(AgentError):
    """The controller did not present the CA the enrollment token names."""


@dataclass(frozen=True)
class PinnedCa:
    pem: str
    #: The name to verify the controller's certificate under.
    server_name: str


def token_ca_fingerprint(token: str) -> str | None:
    """The ``ca`` claim of an enrollment token (None: absent, or not a dacp1 token). The
    agent cannot check the token's signature (the controller does); a forged fingerprint
    only makes the pin fail."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError):
        return None
    ca = claims.get("ca") if isinstance(claims, dict) else None
    return ca if isinstance(ca, str) and ca else None


def _chain_der(tls: ssl.SSLSocket) -> list[bytes]:
    """The certificates the peer presented, leaf first (DER). Python 3.13 has the public
    ``get_unverified_chain``; 3.11 and 3.12 have it on the underlying ``_sslobj``."""
    getter: Any = getattr(tls, "get_unverified_chain", None)
    chain = getter() if getter is not None else tls._sslobj.get_unverified_chain()  # type: ignore[attr-defined]
    out = []
    for cert in chain or []:
        out.append(cert if isinstance(cert, bytes) else cert.public_bytes(ssl._ssl.ENCODING_DER))  # type: ignore[attr-defined]
    return out


def fetch_pinned_ca(host: str, port: int, fingerprint: str, timeout: float) -> PinnedCa:
    """The controller's CA whose sha256 is ``fingerprint``, taken from the chain it presents
    at ``host:port``. Raises :class:`TlsPinMismatch` when no certificate in it matches, and
    OSError when the controller cannot be reached."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # verified below: by fingerprint, then by gRPC
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=CONTROLLER_TLS_NAME) as tls,
    ):
        chain = _chain_der(tls)
    for der in chain:
        if hashlib.sha256(der).hexdigest() == fingerprint.lower():
            return PinnedCa(ssl.DER_cert_to_PEM_cert(der), _server_name(chain[0]))
    raise TlsPinMismatch(
        f"the controller at {host}:{port} did not present the CA named by the enrollment "
        f"token (sha256 {fingerprint[:16]}…; it presented {len(chain)} certificate(s)): "
        "check the controller address and TLS settings, and that the token comes from this "
        "controller"
    )


def _server_name(leaf_der: bytes) -> str:
    """The name the controller's certificate is issued to: ours when it has it, else its
    first DNS name, else its common name."""
    leaf = x509.load_der_x509_certificate(leaf_der)
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if CONTROLLER_TLS_NAME in names or not names:
        common = leaf.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        if CONTROLLER_TLS_NAME in names or not common:
            return CONTROLLER_TLS_NAME
        return str(common[0].value)
    return str(names[0])
