"""A node's model claims (issue 21, finding 3): the pure rules (domain/model_claims.py), the
facts on the model and the proofs on the node, what the scheduler believes, the claims sweep
(application/model_claims.py) on an in-memory store with a fake gateway and a controlled
clock, and the agent's answer (agent/models/model_proof.py) from a real file."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from agent.models.model_proof import answer as agent_answer
from agent.models.model_store import ModelStore
from application.controller import Controller
from application.model_claims import ModelClaims, ProofAnswer, ProofChallenge
from application.read_models import eligibility_of, model_facts, proves
from application.scheduler import Scheduler, SchedulerConfig, usable_memory
from common.contract import DEFAULT_ALLOWED_PEER_CIDRS
from domain.catalog import code_of
from domain.errors import InvalidCommand
from domain.model import RegisteredModel, model_id
from domain.model_claims import (
    CHALLENGE_RANGES,
    RANGE_BYTES,
    SAMPLE_RANGES,
    STORE,
    ByteRange,
    Samples,
    disagreement,
    facts_of,
    implausible,
    malformed_answer,
    pick_ranges,
    pick_samples,
    range_digest,
    wrong_answers,
)
from domain.placement import MAX_NODE_MEMORY_BYTES, MAX_SLOTS
from infrastructure.live_state import InProcessLiveState
from infrastructure.model_store import ControllerModelStore
from tests.enrollments import ready_node
from tests.unit.domain_builders import new_node
from tests.unit.fakes import FakeReadModel
from wire import control_pb2 as pb

GIB = 1 << 30
#: The model file: 40 KiB of pseudo-random bytes (ten ranges' worth).
FILE = random.Random(7).randbytes(40 * 1024)
SHA = hashlib.sha256(FILE).hexdigest()
SHAPE: dict[str, Any] = {
    "size_bytes": len(FILE),
    "layers": 4,
    "context_length": 2048,
    "kv_bytes_per_token": 512,
    "architecture": "llama",
}


def claim(**changes: Any) -> dict[str, Any]:
    return {"sha256": SHA, "file_name": "m.gguf", **SHAPE, **changes}


# ------------------------------------------------------------------------------ the rules


def test_a_claim_is_refused_for_every_fact_it_states_differently() -> None:
    assert disagreement(claim(), SHAPE) is None
    why = disagreement(claim(size_bytes=64 * GIB, layers=1), SHAPE)
    assert why is not None and "size_bytes 68719476736, not 40960" in why and "layers 1" in why
    assert disagreement(claim(architecture="forged"), SHAPE) is not None


@pytest.mark.parametrize(
    "change",
    [
        {"size_bytes": 0},
        {"size_bytes": 1 << 50},
        {"layers": 0},
        {"layers": 100_000},
        {"context_length": 0},
        {"kv_bytes_per_token": GIB},
        {"architecture": "x" * 65},
    ],
)
def test_no_file_has_an_implausible_shape(change: dict[str, Any]) -> None:
    assert implausible(claim()) is None
    assert implausible(claim(**change)) is not None


def test_ranges_lie_inside_the_file_and_samples_are_distinct() -> None:
    rng = random.Random(1)
    ranges = pick_ranges(len(FILE), CHALLENGE_RANGES, rng.randrange)
    assert len(ranges) == CHALLENGE_RANGES
    assert all(r.length == RANGE_BYTES and r.offset + r.length <= len(FILE) for r in ranges)
    assert pick_ranges(10, 3, rng.randrange) == (ByteRange(0, 10),) * 3  # smaller than one range
    with pytest.raises(ValueError):
        pick_ranges(0, 1, rng.randrange)
    chosen = pick_samples(CHALLENGE_RANGES, SAMPLE_RANGES, rng.randrange)
    assert len(set(chosen)) == CHALLENGE_RANGES and all(0 <= i < SAMPLE_RANGES for i in chosen)
    assert sorted(pick_samples(5, 3, rng.randrange)) == [0, 1, 2]


def test_an_answer_is_right_only_with_every_digest_of_the_file() -> None:
    nonce = b"nonce"
    ranges = pick_ranges(len(FILE), 4, random.Random(2).randrange)
    right = tuple(range_digest(nonce, FILE[r.offset : r.offset + r.length]) for r in ranges)
    assert wrong_answers(right, right) is None
    blank = tuple(range_digest(nonce, bytes(r.length)) for r in ranges)
    assert wrong_answers(right, blank) == "4 of its 4 range digest(s) are not the file's"
    assert wrong_answers(right, right[:3]) is not None
    other_nonce = tuple(
        range_digest(b"other", FILE[r.offset : r.offset + r.length]) for r in ranges
    )
    assert wrong_answers(right, other_nonce) is not None
    assert malformed_answer(4, right) is None
    assert malformed_answer(4, [b"short"] * 4) is not None


def test_samples_survive_an_event_and_a_subset_keeps_their_pairs() -> None:
    ranges = (ByteRange(0, 4), ByteRange(8, 4), ByteRange(16, 4))
    samples = Samples(b"\x01\x02", ranges, (b"a" * 32, b"b" * 32, b"c" * 32))
    nonce, recorded = samples.to_event()
    assert Samples.from_event(nonce, recorded) == samples
    sub = samples.subset([2, 0])
    assert sub.ranges == (ranges[2], ranges[0]) and sub.digests == (b"c" * 32, b"a" * 32)


# ------------------------------------------------------------------ facts and proofs


def samples_of(data: bytes, count: int = SAMPLE_RANGES) -> Samples:
    nonce = b"sampled"
    ranges = pick_ranges(len(data), count, random.Random(3).randrange)
    return Samples(
        nonce,
        ranges,
        tuple(range_digest(nonce, data[r.offset : r.offset + r.length]) for r in ranges),
    )


def test_the_store_fixes_the_facts_and_a_node_never_replaces_them() -> None:
    model = RegisteredModel.register("m", SHA, "m.gguf")
    nonce, recorded = samples_of(FILE).to_event()
    model.fix_shape(SHAPE, "node-a", nonce, recorded)  # only nodes hold it: the first proof
    assert (model.shape, model.shape_from) == (SHAPE, "node-a")
    with pytest.raises(InvalidCommand, match="fixed by node node-a"):
        model.fix_shape({**SHAPE, "layers": 5}, "node-b", nonce, recorded)
    model.fix_shape({**SHAPE, "layers": 5}, "node-b", nonce, recorded, fixer_revoked=True)
    assert model.shape_from == "node-b"
    model.store(
        size_bytes=len(FILE),
        layers=4,
        context_length=2048,
        kv_bytes_per_token=512,
        architecture="llama",
    )  # the controller read the file itself: its facts win
    assert (model.shape, model.shape_from, model.samples) == (SHAPE, STORE, None)
    with pytest.raises(InvalidCommand, match="come from the model store"):
        model.fix_shape(SHAPE, "node-c", nonce, recorded, fixer_revoked=True)
    model.fix_shape(SHAPE, STORE, nonce, recorded)  # samples of the store's copy
    with pytest.raises(InvalidCommand, match="sampled already"):
        model.fix_shape(SHAPE, STORE, nonce, recorded)
    model.unstore()
    assert model.shape == SHAPE and model.samples is not None  # still the file's facts
    model.update("f" * 64, "m.gguf", 2048)  # another file: nothing is known of it
    assert (model.shape, model.shape_from, model.samples) == (None, None, None)


def test_a_first_proof_cannot_fix_an_implausible_shape() -> None:
    model = RegisteredModel.register("m", SHA, "m.gguf")
    nonce, recorded = samples_of(FILE).to_event()
    with pytest.raises(InvalidCommand, match="no file is like that"):
        model.fix_shape({**SHAPE, "kv_bytes_per_token": GIB}, "node-a", nonce, recorded)


def test_a_proof_holds_while_the_node_reports_the_file_as_proven() -> None:
    node = new_node()
    node.become_ready()
    node.report_resources({}, [claim()])
    with pytest.raises(Exception, match="no longer reports"):
        node.model_proven(SHA, STORE, facts_of(claim(size_bytes=1)))
    node.model_proven(SHA, STORE, facts_of(claim()))
    assert node.proofs() == {SHA: {"basis": STORE, "claim": facts_of(claim())}}
    node.report_resources({}, [claim(), {"sha256": "b" * 64, "size_bytes": 1}])
    assert SHA in node.proofs()  # another file came: the proof stands
    node.report_resources({}, [claim(size_bytes=1)])
    assert node.proofs() == {}  # the claim changed: proven no more
    node.report_resources({}, [claim()])
    node.model_proven(SHA, STORE, facts_of(claim()))
    node.refuse_model_claim(SHA, "m.gguf", "wrong", facts_of(claim()), STORE)
    assert node.proofs() == {}
    node.model_proven(SHA, STORE, facts_of(claim()))
    node.revoke("stolen", "admin")
    assert node.proofs() == {}
    with pytest.raises(Exception, match="revoked"):
        node.model_proven(SHA, STORE, facts_of(claim()))


def test_a_node_offers_at_most_max_slots() -> None:
    assert new_node(slots=10_000).slots == MAX_SLOTS


def test_usable_memory_never_exceeds_the_nodes_total_nor_the_cap() -> None:
    eligible = {"free_memory_bytes": 64 * GIB}
    node = {"resources": {"ram_total_bytes": 8 * GIB, "gpus": []}, "inventory": {}}
    assert usable_memory(eligible, node, None) == 8 * GIB
    huge = {"resources": {"ram_total_bytes": 1 << 60, "gpus": []}, "inventory": {}}
    assert usable_memory({"free_memory_bytes": 1 << 60}, huge, None) == MAX_NODE_MEMORY_BYTES


# ------------------------------------------------------------------------- a cluster


class Gateway:
    """Records ProveModel challenges; ``disconnected`` nodes have no stream."""

    def __init__(self) -> None:
        self.challenges: list[tuple[str, ProofChallenge]] = []
        self.disconnected: set[str] = set()

    def is_connected(self, node_id: str) -> bool:
        return node_id not in self.disconnected

    def prove_model(self, node_id: str, challenge: ProofChallenge) -> bool:
        if node_id in self.disconnected:
            return False
        self.challenges.append((node_id, challenge))
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """An in-memory controller, its read model, a gateway and a claims sweep; the store copy
    of the file is ``store`` (sha256 → bytes)."""

    def __init__(self, *, stored: bool) -> None:
        self.app = Controller()
        self.read = FakeReadModel(self.app)
        self.gateway = Gateway()
        self.clock = Clock()
        self.store: dict[str, bytes] = {SHA: FILE} if stored else {}
        self.proven_calls = 0
        rng = random.Random(11)
        self.claims = ModelClaims(
            self.app,
            self.read,
            self.gateway,
            self.store_ranges,
            clock=self.clock,
            below=rng.randrange,
            nonce=rng.randbytes,
            on_proven=self._proven,
        )
        if stored:
            self.app.store_model("m", SHA, "m.gguf", SHAPE)
        else:
            self.app.register_model("m", SHA, "m.gguf")

    def _proven(self) -> None:
        self.proven_calls += 1

    def store_ranges(self, sha256: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        data = self.store.get(sha256)
        if data is None:
            return None
        return [data[r.offset : r.offset + r.length] for r in ranges]

    def node(self, name: str, *, claims: list[dict[str, Any]] | None = None) -> str:
        inventory = {"ram_total_bytes": 8 * GIB, "gpus": []}
        node_id = ready_node(
            self.app, name, inventory=inventory, address="10.0.0.1", token_id=f"t-{name}"
        )
        resources = {"ram_total_bytes": 8 * GIB, "ram_free_bytes": 8 * GIB, "gpus": []}
        self.app.report_resources(node_id, resources, claims if claims is not None else [claim()])
        return node_id

    def challenges_to(self, node_id: str) -> list[ProofChallenge]:
        return [c for n, c in self.gateway.challenges if n == node_id]

    def answer(self, node_id: str, data: bytes = FILE, **changes: Any) -> str | None:
        challenge = self.challenges_to(node_id)[-1]
        digests = tuple(
            range_digest(challenge.nonce, data[r.offset : r.offset + r.length])
            for r in challenge.ranges
        )
        fields = {"digests": digests, "error": "", **changes}
        return self.claims.answered(
            node_id,
            ProofAnswer(
                challenge.challenge_id, challenge.sha256, fields["digests"], fields["error"]
            ),
        )

    def codes(self, ident: str) -> list[str]:
        return [code_of(e) for e in self.app.events.get(UUID(ident))]

    def row(self, node_id: str) -> dict[str, Any]:
        found = self.read.get_node(node_id)
        assert found is not None
        return found

    def model(self) -> dict[str, Any]:
        found = self.read.get_model("m")
        assert found is not None
        return found


def test_a_stored_models_claim_is_proven_against_the_stores_copy() -> None:
    cluster = Cluster(stored=True)
    node = cluster.node("a")
    assert cluster.claims.sweep() == 1
    (challenge,) = cluster.challenges_to(node)
    assert len(challenge.ranges) == CHALLENGE_RANGES and len(challenge.nonce) == 16
    assert cluster.claims.proving(cluster.model())
    assert cluster.answer(node) is None
    assert cluster.codes(node)[-1] == "MODEL_PROVEN" and cluster.proven_calls == 1
    assert proves(cluster.row(node), SHA, STORE) and not cluster.claims.proving(cluster.model())
    eligible = eligibility_of(cluster.row(node))
    assert eligible is not None and eligible["proven_models"] == {SHA: STORE}
    assert cluster.claims.sweep() == 0  # proven: nothing more to ask
    # The store recorded samples of its copy on the way (MODEL_SHAPE_FIXED, source store).
    assert cluster.model()["proof_samples"] == SAMPLE_RANGES


def test_a_wrong_answer_is_refused_and_not_asked_again_for_a_while() -> None:
    cluster = Cluster(stored=True)
    node = cluster.node("a")
    cluster.claims.sweep()
    assert cluster.answer(node, data=bytes(len(FILE))) is None
    assert cluster.codes(node)[-1] == "MODEL_CLAIM_REFUSED"
    refused = cluster.row(node)["refused_models"][SHA]
    assert "proof challenge was wrong" in refused["reason"] and refused["basis"] == STORE
    assert not cluster.claims.proving(cluster.model())
    assert cluster.claims.sweep() == 0  # cooling down
    cluster.clock.now += cluster.claims.retry
    assert cluster.claims.sweep() == 1 and cluster.claims.proving(cluster.model())
    assert cluster.answer(node) is None
    assert cluster.codes(node)[-1] == "MODEL_PROVEN"
    assert SHA not in cluster.row(node)["refused_models"]


def test_a_claim_that_disagrees_is_refused_once_and_never_challenged() -> None:
    cluster = Cluster(stored=True)
    node = cluster.node("forger", claims=[claim(size_bytes=64 * GIB, layers=1)])
    assert cluster.claims.sweep() == 0 and cluster.challenges_to(node) == []
    assert cluster.claims.sweep() == 0
    assert cluster.codes(node).count("MODEL_CLAIM_REFUSED") == 1
    assert "size_bytes 68719476736" in cluster.row(node)["refused_models"][SHA]["reason"]
    assert not cluster.claims.proving(cluster.model())


def test_what_a_node_says_is_recorded_printable_and_short() -> None:
    cluster = Cluster(stored=True)
    weird = claim(architecture="llama\0" + "x" * 1_000_000, file_name="m\0.gguf")
    node = cluster.node("weird", claims=[weird])
    cluster.claims.sweep()
    refused = cluster.row(node)["refused_models"][SHA]
    architecture = refused["claim"]["architecture"]
    assert architecture.startswith("llama\\x00xxx") and architecture.endswith(" characters)")
    assert len(architecture) < 300
    assert refused["file_name"] == "m\\x00.gguf" and len(refused["reason"]) < 1000
    cluster.claims.sweep()
    assert cluster.codes(node).count("MODEL_CLAIM_REFUSED") == 1  # the same claim, once
    other = cluster.node("other")
    cluster.claims.sweep()
    assert cluster.answer(other, error="gone\0" * 100) is None
    error = cluster.row(other)["refused_models"][SHA]["reason"]
    assert "\0" not in error and "gone\\x00" in error and len(error) < 300


def test_silence_is_refused_after_the_timeout() -> None:
    cluster = Cluster(stored=True)
    node = cluster.node("mute")
    cluster.claims.sweep()
    cluster.clock.now += cluster.claims.timeout - 1
    cluster.claims.sweep()
    assert "MODEL_CLAIM_REFUSED" not in cluster.codes(node)
    cluster.clock.now += 1
    cluster.claims.sweep()
    assert "did not answer" in cluster.row(node)["refused_models"][SHA]["reason"]
    assert cluster.answer(node) == "a model proof that answers no challenge of this node's"


def test_an_answer_for_another_node_or_an_error_proves_nothing() -> None:
    cluster = Cluster(stored=True)
    a, b = cluster.node("a"), cluster.node("b")
    cluster.claims.sweep()
    challenge = cluster.challenges_to(a)[-1]
    stolen = ProofAnswer(challenge.challenge_id, SHA, ())
    assert cluster.claims.answered(b, stolen) is not None  # b cannot answer a's challenge
    assert cluster.answer(a, error="no file with that sha256 here") is None
    assert "could not answer" in cluster.row(a)["refused_models"][SHA]["reason"]


def test_the_first_proof_of_a_file_only_nodes_hold_fixes_the_facts() -> None:
    cluster = Cluster(stored=False)
    a = cluster.node("a")
    b = cluster.node("b")
    assert model_facts(cluster.model(), {}) is None
    assert cluster.claims.sweep() == 1  # one first proof at a time
    (first,) = cluster.challenges_to(a) or cluster.challenges_to(b)
    fixer = a if cluster.challenges_to(a) else b
    other = b if fixer == a else a
    assert len(first.ranges) == SAMPLE_RANGES
    assert cluster.answer(fixer) is None
    model = cluster.model()
    assert (model["shape"], model["shape_from"]) == (SHAPE, fixer)
    assert cluster.codes(fixer)[-1] == "MODEL_PROVEN"
    assert cluster.claims.sweep() == 1  # the other node, checked against the samples
    (second,) = cluster.challenges_to(other)
    assert len(second.ranges) == CHALLENGE_RANGES and second.nonce == first.nonce
    assert cluster.answer(other) is None
    assert proves(cluster.row(other), SHA, fixer)


def test_a_node_that_cannot_match_the_first_proof_is_refused() -> None:
    cluster = Cluster(stored=False)
    honest = cluster.node("honest")
    cluster.claims.sweep()
    cluster.answer(honest)
    pretender = cluster.node("pretender")
    cluster.claims.sweep()
    cluster.answer(pretender, data=bytes(len(FILE)))
    assert "was wrong" in cluster.row(pretender)["refused_models"][SHA]["reason"]
    forger = cluster.node("forger", claims=[claim(kv_bytes_per_token=1)])
    cluster.claims.sweep()
    assert cluster.challenges_to(forger) == []
    assert "kv_bytes_per_token 1, not 512" in cluster.row(forger)["refused_models"][SHA]["reason"]


def test_a_revoked_fixers_facts_count_for_nothing() -> None:
    cluster = Cluster(stored=False)
    liar = cluster.node("liar", claims=[claim(kv_bytes_per_token=32 << 20)])
    cluster.claims.sweep()
    cluster.answer(liar, data=bytes(len(FILE)))  # nobody can tell yet
    assert cluster.model()["shape_from"] == liar
    honest = cluster.node("honest")
    cluster.claims.sweep()
    assert cluster.challenges_to(honest) == []  # it disagrees with the liar's facts
    assert "MODEL_CLAIM_REFUSED" in cluster.codes(honest)
    cluster.app.revoke_node(liar, "lies", "admin")
    rows = {n["node_id"]: n for n in cluster.read.list_nodes()}
    assert model_facts(cluster.model(), rows) is None
    assert cluster.claims.proving(cluster.model())
    cluster.claims.sweep()
    cluster.answer(honest)
    assert (cluster.model()["shape"], cluster.model()["shape_from"]) == (SHAPE, honest)
    events = cluster.app.events.get(model_id("m"))
    fixed = [getattr(e, "source", "") for e in events if code_of(e) == "MODEL_SHAPE_FIXED"]
    assert fixed == [liar, honest]


def test_once_the_store_lets_the_file_go_proofs_are_checked_against_its_samples() -> None:
    cluster = Cluster(stored=True)
    cluster.claims.sweep()  # records samples of the store's copy
    assert cluster.model()["proof_samples"] == SAMPLE_RANGES
    cluster.app.unstore_model("m")
    cluster.store.clear()
    node = cluster.node("late")
    cluster.claims.sweep()
    (challenge,) = cluster.challenges_to(node)
    assert len(challenge.ranges) == CHALLENGE_RANGES
    assert cluster.answer(node) is None
    assert proves(cluster.row(node), SHA, STORE)
    liar = cluster.node("liar")
    cluster.claims.sweep()
    cluster.answer(liar, data=bytes(len(FILE)))
    assert "was wrong" in cluster.row(liar)["refused_models"][SHA]["reason"]


def test_without_the_file_or_samples_a_claim_cannot_be_checked_and_is_refused() -> None:
    cluster = Cluster(stored=True)
    cluster.store.clear()  # another controller's store, say: this one never read the file
    node = cluster.node("a")
    assert cluster.claims.sweep() == 0
    assert "cannot be checked here" in cluster.row(node)["refused_models"][SHA]["reason"]
    assert not cluster.claims.proving(cluster.model())


def test_the_scheduler_plans_only_proven_holders_with_the_registered_facts() -> None:
    cluster = Cluster(stored=True)
    live = InProcessLiveState()
    scheduler = Scheduler(cluster.read, live, SchedulerConfig(DEFAULT_ALLOWED_PEER_CIDRS))
    liar = cluster.node("liar", claims=[claim(size_bytes=64 * GIB)])
    honest = cluster.node("honest")
    for node_id in (liar, honest):
        live.mark_connected(node_id, True, 0.0)
        live.record_heartbeat(node_id, {}, 0.0)
    request = {**cluster.model(), "shape": None, "shape_from": None}  # an older row
    placed = scheduler.place(request)
    assert placed.plan is None  # nobody proved anything yet
    cluster.claims.sweep()
    cluster.answer(honest)
    placed = scheduler.place(request)
    assert placed.plan is not None and placed.plan.primary.node_id == honest
    # The facts are the store's, whatever the liar says: 40 KiB of weights.
    assert placed.plan.required_bytes < 64 << 20 << 2


# ------------------------------------------------------------------------ the agent


def test_the_agent_answers_from_the_file_its_hash_cache_knows(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").write_bytes(FILE)
    store = ModelStore(models, tmp_path / "data", progress=None)
    store.cache.put(
        (models / "m.gguf").absolute(),
        _entry((models / "m.gguf").stat()),
    )
    store.cache.save()
    ranges = pick_ranges(len(FILE), 4, random.Random(5).randrange)
    challenge = pb.ProveModel(
        challenge_id="c1",
        model_sha256=SHA,
        nonce=b"n0",
        ranges=[pb.ByteRange(offset=r.offset, length=r.length) for r in ranges],
    )
    proof = agent_answer(store, challenge)
    assert proof.error == "" and proof.challenge_id == "c1"
    assert list(proof.digests) == [
        range_digest(b"n0", FILE[r.offset : r.offset + r.length]) for r in ranges
    ]
    beyond = pb.ProveModel(
        challenge_id="c2", model_sha256=SHA, ranges=[pb.ByteRange(offset=len(FILE) - 1, length=2)]
    )
    assert "beyond the file" in agent_answer(store, beyond).error
    absent = pb.ProveModel(challenge_id="c3", model_sha256="e" * 64)
    assert "no file with that sha256" in agent_answer(store, absent).error
    greedy = pb.ProveModel(
        challenge_id="c4", model_sha256=SHA, ranges=[pb.ByteRange(offset=0, length=2 << 20)]
    )
    assert "longer than" in agent_answer(store, greedy).error


def _entry(stat: Any) -> Any:
    from agent.models.model_store import _CacheEntry
    from common.gguf_metadata import GgufMetadata

    return _CacheEntry.describing(stat, SHA, GgufMetadata("llama", 0, 4, 2048, 512))


def test_the_store_reads_ranges_of_its_copy(tmp_path: Path) -> None:
    store = ControllerModelStore(tmp_path / "store")
    source = tmp_path / "m.gguf"
    source.write_bytes(FILE)
    store.add(source)
    assert store.read_ranges(SHA, [ByteRange(10, 5)]) == [FILE[10:15]]
    assert store.read_ranges(SHA, [ByteRange(len(FILE) - 2, 5)]) is None
    assert store.read_ranges("e" * 64, [ByteRange(0, 1)]) is None


def test_a_warm_server_whose_primary_no_longer_proves_the_file_is_not_reused() -> None:
    from domain.placement import ExecutionPlan, PlanNode
    from domain.runtimes import runtime_of, warm_choice

    plan = ExecutionPlan(
        "m", SHA, "m.gguf", 2048, 1, PlanNode("n1", "10.0.0.1", 50052, 1), (), (1.0,), 2
    )
    row = {
        "node_id": "n1",
        "state": "READY",
        "drain_requested": False,
        "current_jobs": ["j1"],
        "runtime": runtime_of(plan),
    }
    args: dict[str, Any] = {"model_name": "m", "model_sha256": SHA, "context_size": 2048}
    assert warm_choice({"n1": row}, **args) is not None
    assert warm_choice({"n1": row}, primary_holds=lambda _n: False, **args) is None


def test_every_name_of_a_file_takes_the_facts_proven_under_one() -> None:
    """A chat and an embedding model of one file: the file is proven once, and the second
    name is planned by the same facts (its own MODEL_SHAPE_FIXED, same basis and samples)."""
    cluster = Cluster(stored=False)
    fixer = cluster.node("a")
    cluster.claims.sweep()
    cluster.answer(fixer)
    cluster.app.register_model("m-embed", SHA, "m.gguf")
    rows = {n["node_id"]: n for n in cluster.read.list_nodes()}
    assert model_facts(cluster.read.get_model("m-embed") or {}, rows) is None
    assert cluster.claims.sweep() == 0  # nothing to prove again
    embed = cluster.read.get_model("m-embed")
    assert embed is not None and model_facts(embed, rows) == (SHAPE, fixer)
    assert cluster.app.model_samples("m-embed") == cluster.app.model_samples("m")
    assert proves(cluster.row(fixer), SHA, fixer)
    cluster.claims.sweep()  # once is enough
    events = cluster.app.events.get(model_id("m-embed"))
    assert [code_of(e) for e in events].count("MODEL_SHAPE_FIXED") == 1


def test_a_second_name_of_a_stored_file_takes_the_stores_facts() -> None:
    cluster = Cluster(stored=True)
    cluster.app.register_model("m-embed", SHA, "m.gguf")
    cluster.claims.sweep()
    embed = cluster.read.get_model("m-embed")
    assert embed is not None and model_facts(embed, {}) == (SHAPE, STORE)
    node = cluster.node("a")
    cluster.claims.sweep()
    assert cluster.answer(node) is None
    assert proves(cluster.row(node), SHA, STORE)
