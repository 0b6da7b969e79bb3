"""Enrollment: administrator tokens in, node identity and per-node credential out; and the
check of a node's credential on every ``Connect``.

That check runs for whoever calls, so it is made from memory: the sha256 of each node's
credential, kept current by the events that set or void it (``NODE_ENROLLED``,
``NODE_REVOKED``, as the projection follower applies them, whichever controller recorded
them). A node id the cache does not know yet (enrolled before this controller started, or
through another controller a moment ago) is read from the store, a few reads at a time; an id
the store does not know either is remembered as unknown for a while. A malformed id, or a
credential for a known node, costs no store read and no thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from application.commands import Enrollment
from application.controller import Controller
from application.errors import ApplicationError, NotFound
from domain.bounded_text import ID_MAX, bounded, node_name_problem
from domain.enrollment_token import TokenClaims, mint_token, verify_token
from domain.node import Node

#: Store reads for node ids the cache does not know that may run at once.
STORE_READS = 2
#: How long (s) a node id the store did not know is answered from memory, and how many such
#: ids are remembered.
UNKNOWN_TTL = 30.0
UNKNOWN_MAX = 4096
#: The cached hash of a revoked node's credential: it matches nothing.
_REVOKED = ""


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
    problem = node_name_problem(node_name) if node_name else None
    if problem is not None:
        # Enroll refuses such a name: a token bound to it could never be used.
        raise ValueError(problem)
    token_id = secrets.token_hex(8)
    expires_at = now + ttl_seconds
    token = mint_token(key, token_id, expires_at, single_use, node_name or None, ca_fingerprint)
    return MintedToken(token, token_id, expires_at, single_use, node_name or None)


def _node_id(text: str) -> bool:
    """Whether ``text`` is a node id as enrollment hands them out (a canonical uuid)."""
    try:
        return str(UUID(text)) == text
    except ValueError:
        return False


class EnrollmentService:
    def __init__(
        self, app: Controller, secret: str | None, *, ca_fingerprint: str | None = None
    ) -> None:
        self.app = app
        self._secret = secret
        #: The controller's CA (sha256, hex) that minted tokens carry; None: plaintext.
        self.ca_fingerprint = ca_fingerprint
        self._lock = threading.Lock()
        #: node id -> sha256 of its credential (_REVOKED once revoked).
        self._hashes: dict[str, str] = {}
        #: node id -> when the store last said it knows no such node.
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._reads = asyncio.Semaphore(STORE_READS)
        #: Store reads made for a Connect so far (the rest were answered from memory).
        self.store_reads = 0

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
        self._remember(str(result.aggregate_id), credential_sha256(credential))
        return EnrolledNode(result.aggregate_id, credential, result.position)

    # ------------------------------------------------------------ credentials

    def on_event(self, _position: int, event: object) -> None:
        """The projection follower's listener: keeps the credential cache current."""
        if isinstance(event, Node.Enrolled):
            self._remember(str(event.originator_id), event.credential_sha256)
        elif isinstance(event, Node.Revoked):
            self._remember(str(event.originator_id), _REVOKED)

    def _remember(self, node_id: str, sha256: str, *, authoritative: bool = True) -> None:
        with self._lock:
            self._unknown.pop(node_id, None)
            if authoritative:
                self._hashes[node_id] = sha256
            else:  # a store read: what an event said meanwhile is newer
                self._hashes.setdefault(node_id, sha256)

    def is_revoked(self, node_id: str) -> bool:
        """Whether the cache knows ``node_id`` as revoked (from memory only)."""
        return self._hashes.get(node_id) == _REVOKED

    async def authenticate(self, node_id: str, credential: str, now: float) -> str:
        """The node id a credential speaks for; :class:`Unauthenticated` otherwise. Raises
        what the store raises when a node the cache does not know cannot be read."""
        if not node_id or not credential:
            raise Unauthenticated("missing x-node-id or x-node-credential metadata")
        if not _node_id(node_id):
            raise Unauthenticated(f"unknown node {bounded(node_id, ID_MAX)!r}: not a node id")
        expected = self._hashes.get(node_id)
        if expected is None:
            expected = await self._stored_hash(node_id, now)
        if expected is None:
            raise Unauthenticated(f"unknown node {node_id}")
        if expected == _REVOKED:
            raise Unauthenticated(f"node {node_id} was revoked; enroll it again with a new token")
        if not hmac.compare_digest(expected, credential_sha256(credential)):
            raise Unauthenticated(f"wrong credential for node {node_id}")
        return node_id

    async def _stored_hash(self, node_id: str, now: float) -> str | None:
        """The node's credential hash from the store (None: no such node), read at most
        STORE_READS at a time; an id found unknown is answered from memory for UNKNOWN_TTL."""
        with self._lock:
            seen = self._unknown.get(node_id)
        if seen is not None and now - seen < UNKNOWN_TTL:
            return None
        async with self._reads:
            cached = self._hashes.get(node_id)
            if cached is not None:  # read meanwhile, or an event came
                return cached
            self.store_reads += 1
            stored = await asyncio.to_thread(self._read_hash, node_id)
        if stored is None:
            with self._lock:
                if node_id not in self._hashes:
                    self._unknown[node_id] = now
                    self._unknown.move_to_end(node_id)
                    while len(self._unknown) > UNKNOWN_MAX:
                        self._unknown.popitem(last=False)
            return self._hashes.get(node_id)
        self._remember(node_id, stored, authoritative=False)
        return self._hashes[node_id]

    def _read_hash(self, node_id: str) -> str | None:
        try:
            node = self.app.get_node(node_id)
        except NotFound:
            return None
        return _REVOKED if node.revoked else node.credential_sha256
