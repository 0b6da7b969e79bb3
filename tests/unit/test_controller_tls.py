"""The names an agent verifies the controller under, and the names the controller's CA gives
nodes: no node certificate can carry a name the agent accepts for the controller."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.control.controller_tls import controller_names, trusted_server_name
from common.contract import CONTROLLER_TLS_NAME
from common.transfer_ticket import node_tls_name
from infrastructure.tls import TlsError, issue_node_cert, load_or_create, node_cert_name

NODE = str(uuid.uuid4())


@pytest.mark.parametrize(
    ("host", "names"),
    [
        ("127.0.0.1", [CONTROLLER_TLS_NAME, "127.0.0.1"]),
        ("::1", [CONTROLLER_TLS_NAME, "::1"]),
        ("controller.lan", [CONTROLLER_TLS_NAME, "controller.lan"]),
        (CONTROLLER_TLS_NAME, [CONTROLLER_TLS_NAME]),
        # A URL naming a node is never verified under the node's name.
        (node_tls_name(NODE), [CONTROLLER_TLS_NAME]),
        (node_tls_name(NODE).upper(), [CONTROLLER_TLS_NAME]),
    ],
)
def test_the_controller_is_verified_under_its_own_name_or_the_url_host(
    host: str, names: list[str]
) -> None:
    assert controller_names(host) == names


def test_a_name_saved_under_the_old_rule_is_not_trusted() -> None:
    assert trusted_server_name(CONTROLLER_TLS_NAME, "10.0.0.5")
    assert trusted_server_name("10.0.0.5", "10.0.0.5")
    # Read from an impostor's certificate, or the operator certificate's first name while
    # the agent reaches the controller by another: verified again.
    assert not trusted_server_name(node_tls_name(NODE), "10.0.0.5")
    assert not trusted_server_name("controller.lan", "10.0.0.5")
    assert not trusted_server_name("", "10.0.0.5")


def _csr(common_name: str, *dns: str) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    )
    if dns:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(d) for d in dns]), critical=False
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), key


@pytest.mark.parametrize(
    "node_id",
    [
        "",
        "controller",
        "x" + CONTROLLER_TLS_NAME,
        "*",
        "a.b",
        NODE.upper(),  # the controller's ids are lowercase
        NODE + ".example",
        NODE + "\n",
    ],
)
def test_no_node_certificate_for_anything_but_a_node_id(tmp_path: Path, node_id: str) -> None:
    tls = load_or_create(tmp_path / "tls")
    assert tls.ca_key_pem is not None
    csr, _ = _csr("x")
    with pytest.raises(TlsError, match="not a node id"):
        issue_node_cert(tls.ca_pem, tls.ca_key_pem, node_id, csr)


def test_a_node_certificate_is_named_for_its_node_whatever_it_asks(tmp_path: Path) -> None:
    tls = load_or_create(tmp_path / "tls")
    assert tls.ca_key_pem is not None
    csr, key = _csr(CONTROLLER_TLS_NAME, CONTROLLER_TLS_NAME, "*")
    cert = x509.load_pem_x509_certificate(issue_node_cert(tls.ca_pem, tls.ca_key_pem, NODE, csr))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [node_cert_name(NODE)]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node_tls_name(NODE)
    assert cert.public_key() == key.public_key()  # the key is all it takes from the request
