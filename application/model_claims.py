"""Nodes prove the model files they claim before they run them (the rules are in
domain/model_claims.py).

This controller judges the claims of the nodes connected to it (only it can place work on
them): on every resource report, model registration and revocation, and every
PROOF_SWEEP_SECONDS for the rest. For each registered model a node reports:

- a claim that disagrees with the model's facts (size, layers, context, KV bytes per token,
  architecture) is refused and recorded (``MODEL_CLAIM_REFUSED``), once per claim;
- one that agrees, and is not proven yet, gets a challenge (``ProveModel``): byte ranges picked
  at random and a nonce; the node answers ``sha256(nonce || bytes)`` of each range
  (``ModelProof``). The answers are checked against the controller's store copy when it holds
  the file, else against the samples recorded with the facts. Right: ``MODEL_PROVEN``;
  wrong, an error or no answer within PROOF_TIMEOUT_SECONDS: ``MODEL_CLAIM_REFUSED``, and the
  same claim is not challenged again for PROOF_RETRY_SECONDS;
- when no facts count (only nodes hold the file, and none proved it yet, or the node that did
  was revoked), the first node to answer a challenge of SAMPLE_RANGES ranges fixes them
  with its claim and its answers (``MODEL_SHAPE_FIXED`` + ``MODEL_PROVEN``).

Stored models get samples of the store's copy (``MODEL_SHAPE_FIXED``, source ``store``) as
soon as a sweep finds them without: proofs can then be checked once the store lets the file go.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from application.controller import Controller
from application.errors import NotFound
from application.ports import ReadModel
from application.read_models import model_facts, proves
from application.store_guard import StoreUnavailable
from domain.errors import DomainError
from domain.model import RegisteredModel
from domain.model_claims import (
    CHALLENGE_RANGES,
    NONCE_BYTES,
    SAMPLE_RANGES,
    STORE,
    ByteRange,
    RandomBelow,
    Samples,
    disagreement,
    facts_of,
    implausible,
    malformed_answer,
    pick_ranges,
    pick_samples,
    range_digest,
    recordable,
    wrong_answers,
)
from domain.node import Node
from domain.states import NodeState

log = logging.getLogger(__name__)

#: How long a node has to answer a challenge.
PROOF_TIMEOUT_SECONDS = 10.0
#: How long a claim that failed its challenge waits before it is challenged again.
PROOF_RETRY_SECONDS = 60.0
#: How often claims are looked at besides the events that wake the sweep.
PROOF_SWEEP_SECONDS = 2.0
#: Nodes in these states are judged (a node out of service is planned nowhere anyway).
_JUDGED = frozenset({NodeState.READY, NodeState.BUSY, NodeState.DEGRADED, NodeState.DRAINING})
#: Events after which claims may need judging at once.
_WAKING = (
    Node.ResourcesReported,
    Node.BecameReady,
    Node.Recovered,
    Node.Revoked,
    RegisteredModel.Registered,
    RegisteredModel.Event,
)
#: How often :meth:`ModelClaims.settled` looks.
SETTLE_POLL_SECONDS = 0.02
#: Errors a node's answer may carry into the record, at most.
MAX_ERROR_CHARS = 200


@dataclass(frozen=True)
class ProofChallenge:
    """What ``ProveModel`` carries to the node."""

    challenge_id: str
    sha256: str
    nonce: bytes
    ranges: tuple[ByteRange, ...]


@dataclass(frozen=True)
class ProofAnswer:
    """What a node's ``ModelProof`` said."""

    challenge_id: str
    sha256: str
    digests: tuple[bytes, ...]
    error: str = ""


class ProofGateway(Protocol):
    def is_connected(self, node_id: str) -> bool: ...

    def prove_model(self, node_id: str, challenge: ProofChallenge) -> bool:
        """Sends ``ProveModel``; False when the node has no open stream here."""
        ...


#: The bytes of ranges of the controller's store copy of a file (None: the store does not
#: hold it, or it is shorter than the ranges).
StoreRanges = Callable[[str, Sequence[ByteRange]], list[bytes] | None]


@dataclass
class _Pending:
    challenge: ProofChallenge
    node_id: str
    model_name: str
    file_name: str
    claim: dict[str, Any]
    #: The facts' basis the claim was judged against (None: a first proof, which fixes them).
    basis: str | None
    #: The right answers (None: a first proof; its answers become the samples).
    expected: tuple[bytes, ...] | None
    deadline: float


def _governing(models: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One model per file: a name whose facts come from the store first, then one with
    facts, then the first name (two names of one file share the file's facts)."""
    ranked = sorted(
        models,
        key=lambda m: (m.get("shape_from") != STORE, m.get("shape_from") is None, m["name"]),
    )
    by_sha: dict[str, dict[str, Any]] = {}
    for model in ranked:
        by_sha.setdefault(str(model["sha256"]), model)
    return by_sha


class ModelClaims:
    def __init__(
        self,
        app: Controller,
        read: ReadModel,
        gateway: ProofGateway,
        store_ranges: StoreRanges | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        below: RandomBelow = secrets.randbelow,
        nonce: Callable[[int], bytes] = secrets.token_bytes,
        on_proven: Callable[[], None] = lambda: None,
    ) -> None:
        self.app = app
        self.read = read
        self.gateway = gateway
        self.store_ranges = store_ranges
        self.clock = clock
        self.below = below
        self.nonce = nonce
        #: Called after a proof (on the event loop once :meth:`run` runs): jobs waiting for
        #: capacity look again.
        self.on_proven = on_proven
        self.timeout = PROOF_TIMEOUT_SECONDS
        self.retry = PROOF_RETRY_SECONDS
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        #: (node, sha256) → (claim, basis, until): a failed claim not challenged again yet.
        self._cooldown: dict[tuple[str, str], tuple[dict[str, Any], str | None, float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # ----------------------------------------------------------------- running

    def listener(self, _position: int, event: object) -> None:
        """A projection follower listener: events that may call for a judgement wake the
        sweep (it runs once the views hold them)."""
        if isinstance(event, _WAKING) and self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        """Sweeps when woken, and every PROOF_SWEEP_SECONDS, until cancelled."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except StoreUnavailable as e:  # the next sweep tries again
                log.info("model claims not judged now: %s", e)
            except Exception:
                log.exception("judging the nodes' model claims failed")
            try:
                await asyncio.wait_for(self._wake.wait(), PROOF_SWEEP_SECONDS)
            except TimeoutError:
                pass
            self._wake.clear()

    async def answer(self, node_id: str, answer: ProofAnswer) -> str | None:
        """A node's answer to a challenge; the reason to refuse the message, if it is one."""
        return await asyncio.to_thread(self.answered, node_id, answer)

    # ------------------------------------------------------------------- sweep

    def _rows(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in self.read.list_nodes()}

    def sweep(self) -> int:
        """Judges every claim of the connected nodes once; returns the challenges sent."""
        now = self.clock()
        self._expire(now)
        rows = self._rows()
        every = self.read.list_models()
        models = _governing(every)
        for model in models.values():
            self._sample_store(model)
        self._share_facts(every, models, rows)
        sent = 0
        for node in rows.values():
            if not self._judged(node):
                continue
            for local in node.get("local_models") or ():
                claimed = models.get(str(local.get("sha256")))
                if claimed is not None and self._judge(node, local, claimed, rows, now):
                    sent += 1
        return sent

    def _share_facts(
        self,
        every: list[dict[str, Any]],
        governing: dict[str, dict[str, Any]],
        rows: dict[str, dict[str, Any]],
    ) -> None:
        """Every name of a file takes the facts its governing name holds (a chat and an
        embedding model of one file, say): the file was proven once, under one name."""
        for model in every:
            holder = governing.get(str(model["sha256"]))
            if holder is None or holder["name"] == model["name"]:
                continue
            if model_facts(model, rows) is not None or model_facts(holder, rows) is None:
                continue
            try:
                self.app.share_model_facts(str(model["name"]), str(holder["name"]))
            except (DomainError, NotFound) as e:
                log.info("model %s keeps its facts: %s", model["name"], e)

    def _judged(self, node: dict[str, Any]) -> bool:
        return (
            node["state"] in _JUDGED
            and not node.get("revoked")
            and self.gateway.is_connected(node["node_id"])
        )

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [p for p in self._pending.values() if p.deadline <= now]
            for pending in late:
                del self._pending[pending.challenge.challenge_id]
        for pending in late:
            self._refuse(
                pending, f"it did not answer the proof challenge within {self.timeout:g} s", now
            )

    def _pending_for(self, node_id: str, sha256: str) -> bool:
        with self._lock:
            return any(
                p.node_id == node_id and p.challenge.sha256 == sha256
                for p in self._pending.values()
            )

    def _first_pending(self, sha256: str) -> bool:
        """Whether a first proof of the file is under way (the others wait for its facts)."""
        with self._lock:
            return any(
                p.basis is None and p.challenge.sha256 == sha256 for p in self._pending.values()
            )

    def _judge(
        self,
        node: dict[str, Any],
        local: dict[str, Any],
        model: dict[str, Any],
        rows: dict[str, dict[str, Any]],
        now: float,
    ) -> bool:
        """Refuses, challenges or leaves alone one claim; True when a challenge went out."""
        node_id, sha256 = str(node["node_id"]), str(model["sha256"])
        claim = facts_of(local)
        facts = model_facts(model, rows)
        basis = facts[1] if facts is not None else None
        proof = (node.get("proven_models") or {}).get(sha256) or {}
        if basis is not None and proves(node, sha256, basis) and proof.get("claim") == claim:
            return False
        if self._pending_for(node_id, sha256):
            return False
        why = disagreement(claim, facts[0]) if facts is not None else implausible(claim)
        if why is not None:
            refused = (node.get("refused_models") or {}).get(sha256)
            if refused and refused.get("claim") == claim and refused.get("basis") == (basis or ""):
                return False  # recorded already
            self._record_refusal(
                node_id, sha256, recordable(local.get("file_name") or ""), why, claim, basis
            )
            return False
        if self._cooling(node_id, sha256, claim, basis, now):
            return False
        file_name = recordable(local.get("file_name") or "")
        expected: tuple[bytes, ...] | None = None
        if facts is None:
            if self._first_pending(sha256):
                return False  # one node's proof fixes the facts; the others are checked by them
            nonce = self.nonce(NONCE_BYTES)
            ranges = pick_ranges(claim["size_bytes"], SAMPLE_RANGES, self.below)
        else:
            check = self._expected(model, claim["size_bytes"])
            if check is None:
                why = (
                    "it cannot be checked here: the controller's model store does not hold "
                    "the file and no samples of it were recorded"
                )
                self._cool(node_id, sha256, claim, basis, now)
                self._record_refusal(node_id, sha256, file_name, why, claim, basis)
                return False
            nonce, ranges, expected = check
        challenge = ProofChallenge(str(uuid.uuid4()), sha256, nonce, ranges)
        pending = _Pending(
            challenge,
            node_id,
            str(model["name"]),
            file_name,
            claim,
            basis,
            expected,
            now + self.timeout,
        )
        with self._lock:
            self._pending[challenge.challenge_id] = pending
        if not self.gateway.prove_model(node_id, challenge):
            with self._lock:
                self._pending.pop(challenge.challenge_id, None)
            return False
        return True

    def _expected(
        self, model: dict[str, Any], size: int
    ) -> tuple[bytes, tuple[ByteRange, ...], tuple[bytes, ...]] | None:
        """(nonce, ranges, right answers) of a challenge: fresh ranges of the store's copy,
        else some of the recorded samples (None: neither is here)."""
        sha256 = str(model["sha256"])
        if self.store_ranges is not None:
            nonce = self.nonce(NONCE_BYTES)
            ranges = pick_ranges(size, CHALLENGE_RANGES, self.below)
            data = self.store_ranges(sha256, ranges)
            if data is not None:
                return nonce, ranges, tuple(range_digest(nonce, d) for d in data)
        try:
            now_sha, samples = self.app.model_samples(str(model["name"]))
        except NotFound:
            return None
        if samples is None or now_sha != sha256 or not samples.ranges:
            return None
        chosen = samples.subset(pick_samples(CHALLENGE_RANGES, len(samples.ranges), self.below))
        return chosen.nonce, chosen.ranges, chosen.digests

    def _sample_store(self, model: dict[str, Any]) -> None:
        """Records samples of the store's copy of a stored model that has none."""
        if self.store_ranges is None or model.get("shape_from") != STORE:
            return
        if model.get("proof_samples") or not model.get("shape"):
            return
        size = int(model["shape"]["size_bytes"])
        nonce = self.nonce(NONCE_BYTES)
        ranges = pick_ranges(size, SAMPLE_RANGES, self.below)
        data = self.store_ranges(str(model["sha256"]), ranges)
        if data is None:
            return
        samples = Samples(nonce, ranges, tuple(range_digest(nonce, d) for d in data))
        try:
            self.app.sample_stored_model(str(model["name"]), str(model["sha256"]), samples)
        except (DomainError, NotFound) as e:
            log.info("samples of model %s: %s", model["name"], e)

    # ----------------------------------------------------------------- answers

    def answered(self, node_id: str, answer: ProofAnswer) -> str | None:
        """Judges a node's answer (in a worker thread: it may read files and write the
        store). Returns why the message is refused, if it answers no challenge of this
        node's."""
        with self._lock:
            pending = self._pending.get(answer.challenge_id)
            if pending is None or pending.node_id != node_id:
                return "a model proof that answers no challenge of this node's"
            del self._pending[answer.challenge_id]
        now = self.clock()
        if answer.sha256 != pending.challenge.sha256:
            self._refuse(pending, "its answer to the proof challenge names another file", now)
            return None
        if answer.error:
            error = recordable(answer.error, MAX_ERROR_CHARS)
            self._refuse(pending, f"it could not answer the proof challenge: {error}", now)
            return None
        ranges = len(pending.challenge.ranges)
        why = malformed_answer(ranges, answer.digests)
        if why is None and pending.expected is not None:
            why = wrong_answers(pending.expected, answer.digests)
        if why is not None:
            self._refuse(pending, f"its answer to the proof challenge was wrong: {why}", now)
            return None
        model = self.read.get_model(pending.model_name)
        facts = model_facts(model, self._rows()) if model is not None else None
        if model is None or model["sha256"] != pending.challenge.sha256:
            return None  # re-registered meanwhile: nothing to prove any more
        if (facts[1] if facts is not None else None) != pending.basis:
            return None  # the facts changed meanwhile: the next sweep challenges anew
        try:
            if pending.basis is None:
                samples = Samples(pending.challenge.nonce, pending.challenge.ranges, answer.digests)
                self.app.prove_first(
                    node_id, pending.model_name, pending.challenge.sha256, pending.claim, samples
                )
                log.info(
                    "node %s proved it holds model %s first: its facts fixed the model's",
                    node_id,
                    pending.model_name,
                )
            else:
                self.app.model_proven(
                    node_id, pending.challenge.sha256, pending.basis, pending.claim
                )
        except (DomainError, NotFound) as e:
            log.info(
                "proof of model %s by node %s not recorded: %s", pending.model_name, node_id, e
            )
            return None
        with self._lock:
            self._cooldown.pop((node_id, pending.challenge.sha256), None)
        if self._loop is not None:  # answers are judged in worker threads
            self._loop.call_soon_threadsafe(self.on_proven)
        else:
            self.on_proven()
        return None

    def _cool(
        self, node_id: str, sha256: str, claim: dict[str, Any], basis: str | None, now: float
    ) -> None:
        """The claim is not challenged again for PROOF_RETRY_SECONDS (while it is the same)."""
        with self._lock:
            self._cooldown[(node_id, sha256)] = (claim, basis, now + self.retry)

    def _cooling(
        self, node_id: str, sha256: str, claim: dict[str, Any], basis: str | None, now: float
    ) -> bool:
        with self._lock:
            cooled = self._cooldown.get((node_id, sha256))
        return cooled is not None and cooled[:2] == (claim, basis) and now < cooled[2]

    def _refuse(self, pending: _Pending, reason: str, now: float) -> None:
        self._cool(pending.node_id, pending.challenge.sha256, pending.claim, pending.basis, now)
        self._record_refusal(
            pending.node_id,
            pending.challenge.sha256,
            pending.file_name,
            reason,
            pending.claim,
            pending.basis,
        )

    def _record_refusal(
        self,
        node_id: str,
        sha256: str,
        file_name: str,
        reason: str,
        claim: dict[str, Any],
        basis: str | None,
    ) -> None:
        log.warning("node %s: its claim of file %s refused: %s", node_id, sha256[:12], reason)
        try:
            self.app.refuse_model_claim(node_id, sha256, file_name, reason, claim, basis or "")
        except (DomainError, NotFound) as e:
            log.info("refusal of node %s's claim not recorded: %s", node_id, e)

    # ----------------------------------------------------------------- waiting

    async def settled(self, model: dict[str, Any], timeout: float) -> None:
        """Returns once no connected node that reports the model's file is still to prove
        it (or after ``timeout``): a model just registered is then served by them at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.proving(model) and loop.time() < deadline:
            await asyncio.sleep(SETTLE_POLL_SECONDS)

    def proving(self, model: dict[str, Any]) -> bool:
        """Whether a connected node that reports the model's file may prove it holds it
        soon: its claim is neither proven nor refused yet (jobs wait for it)."""
        sha256 = str(model["sha256"])
        rows = self._rows()
        current = self.read.get_model(str(model["name"])) or model
        facts = model_facts(current, rows) if current["sha256"] == sha256 else None
        basis = facts[1] if facts is not None else None
        now = self.clock()
        for node in rows.values():
            local = next(
                (m for m in node.get("local_models") or () if m.get("sha256") == sha256), None
            )
            if local is None or not self._judged(node):
                continue
            claim = facts_of(local)
            if basis is not None and proves(node, sha256, basis):
                continue
            if facts is not None and disagreement(claim, facts[0]) is not None:
                continue
            if facts is None and implausible(claim) is not None:
                continue
            node_id = str(node["node_id"])
            if self._pending_for(node_id, sha256):
                return True
            if not self._cooling(node_id, sha256, claim, basis, now):
                return True  # the next sweep challenges it
        return False
