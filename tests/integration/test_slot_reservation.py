"""Slot reservation is atomic in the event store: two controllers sharing one Postgres database
never book the same slot twice.

Each "controller" is its own Controller application (its own connection pool and aggregate
cache), as a second controller process would be; they race for one single-slot node, round after
round, released between rounds.
"""

from __future__ import annotations

import threading
from uuid import UUID, uuid4

from application.commands import ChatPrompt, JobOutcome, Submission
from application.controller import Controller, NewDispatch
from domain.errors import SlotTaken
from domain.node import Node
from tests.integration.store_builders import enroll_ready
from tests.plans import one_node_plan

ROUNDS = 15


def test_two_controllers_never_double_book_a_slot(postgres_env: dict[str, str]) -> None:
    controllers = [Controller(env=postgres_env), Controller(env=postgres_env)]
    node_id = str(enroll_ready(controllers[0]))
    request = Submission("m", ChatPrompt([{"role": "user", "content": "x"}]))
    barrier = threading.Barrier(2)
    won: list[list[UUID]] = [[], []]
    lost: list[int] = [0, 0]

    def contend(index: int) -> None:
        app = controllers[index]
        for _ in range(ROUNDS):
            barrier.wait()
            job_id = uuid4()
            try:
                app.record_new_jobs(
                    [NewDispatch(request, job_id, one_node_plan(node_id), {node_id: "primary"})]
                )
            except SlotTaken:
                lost[index] += 1
            else:
                won[index].append(job_id)
            barrier.wait()  # both have tried; the winner releases the slot
            if won[index] and won[index][-1] == job_id:
                app.validate_setup(job_id)
                app.complete(job_id, JobOutcome("stop", 1, 1, 1.0, 1.0))

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert all(not thread.is_alive() for thread in threads)

    assert len(won[0]) + len(won[1]) == ROUNDS  # exactly one winner per round
    assert lost[0] + lost[1] == ROUNDS
    # The node's own history: a job is never assigned while another holds the only slot.
    held: set[str] = set()
    for event in controllers[0].repository.event_store.get(UUID(node_id)):
        if isinstance(event, Node.JobAssigned):
            assert not held, f"{event.job_id} assigned while {held} held the slot"
            held.add(event.job_id)
        elif isinstance(event, Node.JobReleased):
            held.discard(event.job_id)
    for app in controllers:
        app.close()
