"""Enrollment: administrator tokens in, node identity and per-node credential out."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from application.commands import Enrollment
from application.controller import Controller
from application.errors import ApplicationError, NotFound
from domain.enrollment_token import TokenClaims, mint_token, verify_token
from domain.node import Node


class Unauthenticated(ApplicationError):
    code = "unauthenticated"


class EnrollmentNotConfigured(ApplicationError):
    code = "enrollment_not_configured"


def credential_sha256(credential: str) -> str:
    return hashlib.sha256(credential.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class MintedToken:
    token: str
    token_id: str
    expires_at: float
    single_use: bool
    node_name: str | None


@dataclass(frozen=True)
class EnrolledNode:
    node_id: UUID
    credential: str
    position: int


def enrollment_key(secret: str | None) -> bytes:
    if not secret:
        raise EnrollmentNotConfigured(
            "NODE_ENROLLMENT_SECRET is not set on the controller; enrollment is disabled"
        )
    return secret.encode("utf-8")


#: A token lives an hour unless asked otherwise, and a week at most.
DEFAULT_TOKEN_TTL = 3600.0
MAX_TOKEN_TTL = 7 * 24 * 3600.0


def mint_enrollment_token(
    key: bytes,
    *,
    ttl_seconds: float,
    single_use: bool,
    node_name: str | None,
    now: float,
    ca_fingerprint: str | None = None,
) -> MintedToken:
    """A token signed with ``key``, valid for ``ttl_seconds`` (no store needed), carrying
    the fingerprint of the controller's CA when it serves TLS."""
    if not 0 < ttl_seconds <= MAX_TOKEN_TTL:
        raise ValueError(f"a token lives more than 0 s and at most {MAX_TOKEN_TTL:.0f} s (7 days)")
    token_id = secrets.token_hex(8)
    expires_at = now + ttl_seconds
    token = mint_token(key, token_id, expires_at, single_use, node_name or None, ca_fingerprint)
    return MintedToken(token, token_id, expires_at, single_use, node_name or None)


class EnrollmentService:
    def __init__(
        self, app: Controller, secret: str | None, *, ca_fingerprint: str | None = None
    ) -> None:
        self.app = app
        self._secret = secret
        #: The controller's CA (sha256, hex) that minted tokens carry; None: plaintext.
        self.ca_fingerprint = ca_fingerprint

    def _key(self) -> bytes:
        return enrollment_key(self._secret)

    def mint(
        self,
        *,
        ttl_seconds: float,
        single_use: bool,
        node_name: str | None,
        now: float,
        minted_by: str = "admin-api",
    ) -> MintedToken:
        """A token, recorded (ENROLLMENT_TOKEN_MINTED) so it can be listed and revoked."""
        minted = mint_enrollment_token(
            self._key(),
            ttl_seconds=ttl_seconds,
            single_use=single_use,
            node_name=node_name,
            now=now,
            ca_fingerprint=self.ca_fingerprint,
        )
        self.app.record_token(
            minted.token_id,
            expires_at=minted.expires_at,
            single_use=minted.single_use,
            node_name=minted.node_name,
            minted_by=minted_by,
        )
        return minted

    def verify(self, token: str, node_name: str, now: float) -> TokenClaims:
        """Raises :class:`domain.enrollment_token.InvalidTokenError` when refused."""
        return verify_token(self._key(), token, now, node_name)

    def enroll(
        self,
        *,
        token: str,
        name: str,
        inventory: dict[str, Any],
        agent_version: str,
        address: str,
        rpc_port: int,
        labels: dict[str, str],
        slots: int,
        now: float,
    ) -> EnrolledNode:
        claims = self.verify(token, name, now)
        credential = secrets.token_urlsafe(32)
        result = self.app.enroll(
            Enrollment(
                name=name,
                inventory=inventory,
                agent_version=agent_version,
                address=address,
                rpc_port=rpc_port,
                labels=labels,
                credential_sha256=credential_sha256(credential),
                token_id=claims.token_id,
                single_use_token=claims.single_use,
                slots=slots,
            )
        )
        assert result.aggregate_id is not None
        return EnrolledNode(result.aggregate_id, credential, result.position)

    def authenticate(self, node_id: str, credential: str) -> Node:
        """The node a credential speaks for; :class:`Unauthenticated` otherwise."""
        if not node_id or not credential:
            raise Unauthenticated("missing x-node-id or x-node-credential metadata")
        try:
            node = self.app.get_node(node_id)
        except NotFound:
            raise Unauthenticated(f"unknown node {node_id}") from None
        if node.revoked:
            raise Unauthenticated(f"node {node_id} was revoked; enroll it again with a new token")
        if not hmac.compare_digest(node.credential_sha256, credential_sha256(credential)):
            raise Unauthenticated(f"wrong credential for node {node_id}")
        return node
