"""The controller's TLS material: its own certificate authority, created on first start and
kept in ``<DACP_VAR_DIR>/tls/``, and a server certificate it issues itself at every start
(for every name and address it may be reached by, and :data:`SERVER_NAME`). The gRPC control
channel and the HTTPS API both use it.

Agents pin the CA: every enrollment token carries its sha256 fingerprint
(:attr:`ServerTls.fingerprint`), the agent takes the certificate whose fingerprint matches
from the chain the controller presents, and from then on verifies the controller against it
alone, under :data:`SERVER_NAME` (else the host it was given, for an operator's certificate).
The same CA issues every node its certificate (:func:`issue_node_cert`), named for its node:
no node certificate can ever carry :data:`SERVER_NAME`, so none passes as the controller.

An operator's own certificate (``TLS_CERT_FILE`` + ``TLS_KEY_FILE``, its chain up to the CA in
the file or in ``TLS_CA_FILE``) replaces the generated one; its CA is then the one pinned, and
the controller issues no node certificates (it has no CA key).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.contract import CONTROLLER_TLS_NAME
from common.transfer_ticket import node_tls_name

log = logging.getLogger(__name__)

#: The name every certificate the controller issues itself carries (see proto).
SERVER_NAME = CONTROLLER_TLS_NAME
CA_VALIDITY = dt.timedelta(days=3650)
SERVER_VALIDITY = dt.timedelta(days=825)


class TlsError(ValueError):
    """TLS material that cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class ServerTls:
    """What the servers present and what clients pin."""

    ca_pem: bytes
    #: The server certificate followed by the rest of its chain (PEM).
    chain_pem: bytes
    key_pem: bytes
    #: Files holding ``chain_pem`` and ``key_pem`` (uvicorn reads files).
    chain_file: Path
    key_file: Path
    ca_file: Path
    #: The name to verify the server under (:data:`SERVER_NAME` for generated certificates).
    server_name: str
    #: The CA's key, when the CA is the controller's own: it issues node certificates and
    #: signs model transfer tickets (None with the operator's TLS files).
    ca_key_pem: bytes | None = None

    @property
    def fingerprint(self) -> str:
        """sha256 of the CA certificate (DER), lowercase hex: what tokens carry."""
        return fingerprint_of(self.ca_pem)


def fingerprint_of(pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    tmp.replace(path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _new_ca() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Distributed AI Compute Platform"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"dacp controller CA {uuid.uuid4().hex[:8]}"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def local_names() -> tuple[list[str], list[str]]:
    """DNS names and IP addresses this machine may be reached by."""
    names = {SERVER_NAME, "localhost", socket.gethostname()}
    with_fqdn = socket.getfqdn()
    if with_fqdn:
        names.add(with_fqdn)
    addresses = {"127.0.0.1", "::1"}
    try:
        for entries in psutil.net_if_addrs().values():
            for entry in entries:
                if entry.family in (socket.AF_INET, socket.AF_INET6):
                    addresses.add(entry.address.split("%", 1)[0])
    except OSError as e:  # some sandboxes hide the interfaces
        log.debug("cannot list network interfaces: %s", e)
    return sorted(names), sorted(addresses)


def _load_ca(
    ca_pem: bytes, ca_key_pem: bytes
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TlsError("the controller's CA key is not an EC key")
    return ca, ca_key


def _issued_by(
    ca: x509.Certificate,
    name: str,
    public_key: CertificatePublicKeyTypes,
    validity: dt.timedelta,
    alt: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
) -> x509.CertificateBuilder:
    """A certificate the CA issues, to sign: ``name`` (its common name) for ``public_key``,
    also known as ``alt``, for ``usages``, not a CA; valid from five minutes ago for
    ``validity``, at most as long as the CA."""
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + validity, ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )


def issue_server_cert(
    ca_pem: bytes, ca_key_pem: bytes, dns_names: list[str], ip_addresses: list[str]
) -> tuple[bytes, bytes]:
    """A server certificate for the names and addresses, signed by the CA (PEM cert, key)."""
    ca, ca_key = _load_ca(ca_pem, ca_key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    for address in ip_addresses:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            continue
    usages = [ExtendedKeyUsageOID.SERVER_AUTH]
    cert = (
        _issued_by(ca, SERVER_NAME, key.public_key(), SERVER_VALIDITY, alt, usages)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


#: How long a node certificate is valid (a node asks for a new one at every connect).
NODE_VALIDITY = dt.timedelta(days=30)
#: A node id as the controller makes them (a UUID, lowercase): all a node's name may hold.
_NODE_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def node_cert_name(node_id: str) -> str:
    """``dacp-node-<node id>``, for a node id the controller made; :class:`TlsError` for any
    other. A node's certificate is a valid server certificate (it serves model files), so its
    name must never be one a client verifies the controller under: the prefix and the UUID
    leave no room for :data:`SERVER_NAME`, a wildcard, a dot or anything a caller chose."""
    if not _NODE_ID.fullmatch(node_id):
        raise TlsError(f"no certificate for node id {node_id[:64]!r}: not a node id")
    return node_tls_name(node_id)


def issue_node_cert(ca_pem: bytes, ca_key_pem: bytes, node_id: str, csr_pem: bytes) -> bytes:
    """The node's certificate for the key of its signing request: named
    ``dacp-node-<node id>`` (its common name and DNS name), for serving and fetching model
    files (server and client authentication). Nothing else of the request is used (not its
    subject, not its extensions). Raises :class:`TlsError` for a bad request or node id."""
    name = node_cert_name(node_id)
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise TlsError(f"not a certificate signing request: {e}") from e
    if not csr.is_signature_valid:
        raise TlsError("the certificate signing request's signature is invalid")
    ca, ca_key = _load_ca(ca_pem, ca_key_pem)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = _issued_by(ca, name, csr.public_key(), NODE_VALIDITY, [x509.DNSName(name)], usages)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def load_or_create(
    tls_dir: Path,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    ca_file: Path | None = None,
) -> ServerTls:
    """The controller's TLS material: the operator's files when given, else its own CA (made
    on first use, kept in ``tls_dir``) and a server certificate issued now."""
    if (cert_file is None) != (key_file is None):
        raise TlsError("TLS_CERT_FILE and TLS_KEY_FILE go together: set both or neither")
    if cert_file is not None and key_file is not None:
        return _operator_files(cert_file, key_file, ca_file)
    ca_pem, ca_key_pem = _ensure_ca(tls_dir)
    names, addresses = local_names()
    cert_pem, key_pem = issue_server_cert(ca_pem, ca_key_pem, names, addresses)
    chain_file, server_key = tls_dir / "server.pem", tls_dir / "server.key"
    _write_private(chain_file, cert_pem + ca_pem)
    _write_private(server_key, key_pem)
    return ServerTls(
        ca_pem=ca_pem,
        chain_pem=cert_pem + ca_pem,
        key_pem=key_pem,
        chain_file=chain_file,
        key_file=server_key,
        ca_file=ca_path(tls_dir),
        server_name=SERVER_NAME,
        ca_key_pem=ca_key_pem,
    )


def ca_path(tls_dir: Path) -> Path:
    """The controller's own CA certificate in ``tls_dir`` (only a controller creates it)."""
    return tls_dir / "ca.pem"


def _ensure_ca(tls_dir: Path) -> tuple[bytes, bytes]:
    """The controller's own CA (PEM certificate, key), created on first use."""
    cert_path, ca_key_path = ca_path(tls_dir), tls_dir / "ca.key"
    if cert_path.exists() and ca_key_path.exists():
        return cert_path.read_bytes(), ca_key_path.read_bytes()
    ca_pem, ca_key_pem = _new_ca()
    _write_private(ca_key_path, ca_key_pem)
    _write_private(cert_path, ca_pem)
    log.info("created the controller's certificate authority in %s", tls_dir)
    return ca_pem, ca_key_pem


def pinned_ca(
    tls_dir: Path,
    *,
    cert_file: Path | None = None,
    ca_file: Path | None = None,
    create: bool = True,
) -> bytes:
    """The CA certificate (PEM) agents pin and clients trust: the operator's (``TLS_CA_FILE``,
    else the last certificate of ``TLS_CERT_FILE``), or the controller's own, created now if
    the controller has not started yet (with ``create``; else a :class:`TlsError`)."""
    try:
        if ca_file is not None:
            return ca_file.read_bytes()
        if cert_file is not None:
            last = x509.load_pem_x509_certificates(cert_file.read_bytes())[-1]
            return last.public_bytes(serialization.Encoding.PEM)
    except (OSError, ValueError) as e:
        raise TlsError(f"cannot read the CA certificate: {e}") from e
    if not create:
        try:
            return ca_path(tls_dir).read_bytes()
        except OSError:
            raise TlsError(
                f"no controller CA in {tls_dir}: no controller has started with this DACP_VAR_DIR "
                "(start `dacp controller` first, or point DACP_VAR_DIR or DACP_CONFIG at the "
                "controller's)"
            ) from None
    return _ensure_ca(tls_dir)[0]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _operator_files(cert_file: Path, key_file: Path, ca_file: Path | None) -> ServerTls:
    try:
        chain_pem, key_pem = cert_file.read_bytes(), key_file.read_bytes()
        certs = x509.load_pem_x509_certificates(chain_pem)
        ca_pem = (
            ca_file.read_bytes()
            if ca_file is not None
            else certs[-1].public_bytes(serialization.Encoding.PEM)
        )
        x509.load_pem_x509_certificate(ca_pem)
        serialization.load_pem_private_key(key_pem, password=None)
    except (OSError, ValueError, TypeError) as e:
        raise TlsError(f"cannot use TLS_CERT_FILE/TLS_KEY_FILE/TLS_CA_FILE: {e}") from e
    leaf = certs[0]
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        dns = []
    common = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = dns[0] if dns else (str(common[0].value) if common else SERVER_NAME)
    return ServerTls(
        ca_pem=ca_pem,
        chain_pem=chain_pem,
        key_pem=key_pem,
        chain_file=cert_file,
        key_file=key_file,
        ca_file=ca_file or cert_file,
        server_name=name,
    )
