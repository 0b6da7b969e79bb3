"""Pinning the controller's certificate authority at enrollment, and verifying the controller;
the enrollment token the CA comes from is checked for form first (a garbled or truncated one
is named as such, and sent nowhere).

An enrollment token carries the sha256 fingerprint of the controller's CA (its ``ca`` claim).
Before enrolling, the agent opens one TLS connection to the controller without verifying it,
takes from the chain the controller presents the certificate whose fingerprint is the token's,
and from then on verifies the controller against that certificate alone (gRPC's normal
verification, with the pinned CA as the only root). Nothing is copied by hand, and a
controller that cannot show the pinned CA (a man in the middle, a wrong address) is refused.

Chaining to the pinned CA is not enough: the same CA issues every node its certificate
(``dacp-node-<node id>``, valid for serving model files), so an enrolled node could present
one. The controller is verified under its own identity, a name the agent knows without asking
the certificate: :data:`common.contract.CONTROLLER_TLS_NAME`, which every certificate the controller
issues itself carries and no node certificate can (the controller refuses to issue one), else,
for an operator's own certificate, the host of the controller URL the agent was given, as any
TLS client does. Never a name read from the presented certificate, and never a node's name.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from agent.agent_config import AgentError, ConfigError
from common.contract import CONTROLLER_TLS_NAME
from common.enrollment_token_form import TokenFields, TokenFormError, read_token
from common.transfer_ticket import NODE_TLS_NAME_PREFIX

#: What to check when the controller cannot be verified (part of every refusal's message).
TLS_HINT = "check the controller address and TLS settings"


class MalformedEnrollmentToken(ConfigError):
    """The enrollment token is garbled or cut short: no controller would take it."""


class TlsPinMismatch(AgentError):
    """The controller did not present the CA the enrollment token names."""


class ControllerNotVerified(TlsPinMismatch):
    """The controller presented a certificate of the pinned CA that is not the controller's
    (a node's certificate, or one for another name)."""


@dataclass(frozen=True)
class PinnedCa:
    pem: str
    #: The name the controller is verified under: :data:`CONTROLLER_TLS_NAME`, or the host
    #: of the controller URL (an operator's certificate). See :func:`controller_names`.
    server_name: str


def controller_names(host: str) -> list[str]:
    """The names the controller at ``host`` may prove, in the order they are tried: ours, then
    the URL's host unless it is ours or a node's (a node certificate is named for its node)."""
    names = [CONTROLLER_TLS_NAME]
    folded = host.lower().strip("[]")
    if folded and folded != CONTROLLER_TLS_NAME and not folded.startswith(NODE_TLS_NAME_PREFIX):
        names.append(host.strip("[]"))
    return names


def trusted_server_name(name: str, host: str) -> bool:
    """Whether ``name`` (as stored in identity.json) is one the controller at ``host`` may be
    verified under. Identities saved before this rule hold a name read from whatever
    certificate the controller presented at enrollment; those are verified again."""
    return name in controller_names(host)


def checked_token(token: str) -> TokenFields:
    """The claims of an enrollment token whose form is whole, read before the token goes
    anywhere (the agent cannot check its signature: the controller does). Raises
    :class:`MalformedEnrollmentToken` for a garbled or truncated one."""
    try:
        return read_token(token)
    except TokenFormError as e:
        raise MalformedEnrollmentToken(
            f"the enrollment token is malformed or truncated: {e}; copy it again whole, or "
            "mint a new one (dacp token create)"
        ) from None


def token_ca_fingerprint(token: str) -> str | None:
    """The ``ca`` claim of an enrollment token (None: absent, or not a whole token). A forged
    fingerprint only makes the pin fail."""
    try:
        return read_token(token).ca_fingerprint
    except TokenFormError:
        return None


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
    at ``host:port``, and the name the controller proves with a certificate of that CA
    (:func:`verified_server_name`). Raises :class:`TlsPinMismatch` when no certificate in the
    chain matches, :class:`ControllerNotVerified` when the controller's certificate is not the
    controller's, and OSError when the controller cannot be reached."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # verified below: by fingerprint, then by name
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, port), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=CONTROLLER_TLS_NAME) as tls,
    ):
        chain = _chain_der(tls)
    for der in chain:
        if hashlib.sha256(der).hexdigest() == fingerprint.lower():
            pem = ssl.DER_cert_to_PEM_cert(der)
            return PinnedCa(pem, verified_server_name(host, port, pem, timeout))
    raise TlsPinMismatch(
        f"the controller at {host}:{port} did not present the CA the enrollment token names "
        f"(sha256 {fingerprint[:16]}…; it presented {len(chain)} certificate(s)): the token "
        f"comes from another controller, perhaps (mint one on this controller: dacp token "
        f"create); else {TLS_HINT}"
    )


def _verifying_context(ca_pem: str) -> ssl.SSLContext:
    """Verifies a server against ``ca_pem`` alone, as gRPC does (not Python's stricter
    X.509 profile, which an operator's certificate need not meet)."""
    context = ssl.create_default_context(cadata=ca_pem)
    context.verify_flags &= ~getattr(ssl, "VERIFY_X509_STRICT", 0)
    context.set_alpn_protocols(["h2"])
    return context


def verified_server_name(host: str, port: int, ca_pem: str, timeout: float) -> str:
    """The first of :func:`controller_names` the controller at ``host:port`` proves with a
    certificate that chains to ``ca_pem``. Raises :class:`ControllerNotVerified` when it
    proves none (an enrolled node posing as the controller shows a certificate of the same
    CA, issued to ``dacp-node-…``), and OSError when it cannot be reached."""
    context = _verifying_context(ca_pem)
    refusals: list[str] = []
    for name in controller_names(host):
        try:
            with (
                socket.create_connection((host, port), timeout=timeout) as raw,
                context.wrap_socket(raw, server_hostname=name),
            ):
                return name
        except ssl.SSLCertVerificationError as exc:
            refusals.append(f"{name!r}: {exc.verify_message or exc.reason or exc}")
    raise ControllerNotVerified(
        f"the controller at {host}:{port} presented a certificate that is not the "
        f"controller's ({' '.join(refusals)}), such as a node's: {TLS_HINT}"
    )
