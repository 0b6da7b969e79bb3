"""This node's own TLS identity: a key made here and a certificate the controller's CA issues
(asked for in every ``Hello``, given in ``Welcome``), named ``dacp-node-<node id>``. The node
serves model files with it and fetches them with it; both ends verify the other against the
controller's CA, which the agent pinned at enrollment.

Agent code: imports only the standard library, third-party packages and ``proto``.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.transfer_ticket import node_tls_name

KEY_NAME = "node.key"
CERT_NAME = "node.pem"


class NodeTls:
    def __init__(self, data_dir: Path) -> None:
        self.key_path = data_dir / KEY_NAME
        self.cert_path = data_dir / CERT_NAME

    @property
    def ready(self) -> bool:
        """Whether the node has its certificate."""
        return self.cert_path.is_file() and self.key_path.is_file()

    def _key(self) -> ec.EllipticCurvePrivateKey:
        if self.key_path.is_file():
            key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
            if isinstance(key, ec.EllipticCurvePrivateKey):
                return key
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        self.key_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(pem)
        return key

    def csr(self, node_id: str) -> str:
        """A signing request for this node's key (made on first use), as PEM."""
        request = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_tls_name(node_id))])
            )
            .sign(self._key(), hashes.SHA256())
        )
        return request.public_bytes(serialization.Encoding.PEM).decode()

    def store(self, certificate_pem: str) -> None:
        """Keeps the certificate the controller issued (replacing the last one)."""
        x509.load_pem_x509_certificate(certificate_pem.encode())  # a certificate, or ValueError
        tmp = self.cert_path.with_suffix(".new")
        tmp.write_text(certificate_pem, encoding="ascii")
        os.replace(tmp, self.cert_path)

    def _context(self, purpose: ssl.Purpose, ca_pem: str) -> ssl.SSLContext:
        context = ssl.create_default_context(purpose, cadata=ca_pem)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_path, self.key_path)
        return context

    def server_context(self, ca_pem: str) -> ssl.SSLContext:
        """Serving model files: this node's certificate; clients must show theirs."""
        context = self._context(ssl.Purpose.CLIENT_AUTH, ca_pem)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self, ca_pem: str) -> ssl.SSLContext:
        """Fetching model files: the server must be the node it is named for."""
        return self._context(ssl.Purpose.SERVER_AUTH, ca_pem)
