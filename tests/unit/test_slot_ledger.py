"""SlotLedger: this controller's own assignments count before the read model shows them."""

from __future__ import annotations

from typing import Any

from application.slot_ledger import SlotLedger
from domain.runtimes import runtime_of
from tests.unit.test_runtimes import plan


def row(jobs: list[str], state: str = "READY", slots: int = 2) -> dict[str, Any]:
    return {"node_id": "n", "current_jobs": jobs, "state": state, "slots": slots}


def test_a_fresh_assignment_counts_before_the_read_model_sees_it() -> None:
    ledger = SlotLedger()
    ledger.assigned("j1", ["n", "w"])
    ledger.assigned("j2", ["n"])
    adjusted = ledger.adjust(row([]))
    assert adjusted["current_jobs"] == ["j1", "j2"]
    assert adjusted["state"] == "BUSY"  # both slots taken


def test_a_release_frees_the_slot_before_the_read_model_sees_it() -> None:
    ledger = SlotLedger()
    ledger.assigned("j1", ["n"])
    ledger.released("j1")
    adjusted = ledger.adjust(row(["j1", "other"], state="BUSY"))
    assert adjusted["current_jobs"] == ["other"]
    assert adjusted["state"] == "READY"
    # Once the read model shows the release, the entry is forgotten.
    assert ledger.adjust(row(["other"])) == row(["other"])
    assert len(ledger) == 0


def test_rows_of_draining_or_offline_nodes_keep_their_state() -> None:
    ledger = SlotLedger()
    ledger.assigned("j1", ["n"])
    assert ledger.adjust(row([], state="DRAINING"))["state"] == "DRAINING"


def test_an_unchanged_row_is_returned_as_is() -> None:
    ledger = SlotLedger()
    original = row(["x"])
    assert ledger.adjust(original) is original


def test_a_release_the_ledger_did_not_see_is_learned_from_the_read_model() -> None:
    ledger = SlotLedger()
    ledger.assigned("j1", ["n"])
    assert ledger.adjust(row(["j1"]))["current_jobs"] == ["j1"]  # projected: seen
    # The job was ended elsewhere (its node went offline): the row no longer lists it.
    assert ledger.adjust(row([]))["current_jobs"] == []
    assert len(ledger) == 0


def test_a_fresh_assignment_brings_its_server_and_counts_against_its_slots() -> None:
    ledger = SlotLedger()
    runtime = runtime_of(plan("n", parallel=3))
    ledger.assigned("j1", ["n"], runtime)
    ledger.assigned("j2", ["n"], runtime)
    adjusted = ledger.adjust(row([], slots=3))
    assert adjusted["runtime"] == runtime
    assert adjusted["state"] == "READY"  # two of the server's three slots
    ledger.assigned("j3", ["n"], runtime)
    assert ledger.adjust(row([], slots=3))["state"] == "BUSY"


def test_a_replanned_job_stops_counting_on_the_node_it_left() -> None:
    ledger = SlotLedger()
    ledger.assigned("j1", ["n"])
    ledger.assigned("j1", ["w"])  # re-planned onto another node
    # The read model still lists it on n for a while: released here already.
    assert ledger.adjust(row(["j1"]))["current_jobs"] == []
    assert ledger.adjust(row([]))["current_jobs"] == []
    moved = ledger.adjust({**row([]), "node_id": "w"})
    assert moved["current_jobs"] == ["j1"]
