from __future__ import annotations

import pytest

from domain.catalog import code_of
from domain.errors import IllegalTransition, InvalidCommand
from domain.job import MAX_REPLANS, Job
from domain.states import JobState
from tests.unit.domain_builders import TWO_CHUNK_JOB_CODES, complete, job_in, new_job

ALL = ["SUBMITTED", "QUEUED", "PLANNED", "DISPATCHED", "SETUP_VALIDATED", "RUNNING"]


def assert_refused(job: Job, command) -> None:  # type: ignore[no-untyped-def]
    before = (job.state, job.version, len(job.pending_events))
    with pytest.raises(IllegalTransition):
        command(job)
    assert (job.state, job.version, len(job.pending_events)) == before


def test_happy_path_codes_in_order() -> None:
    job = job_in("RUNNING")
    job.record_chunk([{"seq": 1, "text": "b", "tokens": 1}, {"seq": 2, "text": "c", "tokens": 2}])
    complete(job, prompt_tokens=5, completion_tokens=4)
    assert job.state == JobState.COMPLETED
    assert job.tokens_streamed == 4
    assert [code_of(e) for e in job.collect_events()] == TWO_CHUNK_JOB_CODES


@pytest.mark.parametrize(("model", "message_count"), [("", 1), ("m", 0)])
def test_submit_validates(model: str, message_count: int) -> None:
    with pytest.raises(InvalidCommand):
        Job.submit(
            job_id=None,
            model=model,
            params={},
            messages=[],
            prompt_sha256="",
            message_count=message_count,
            stream=False,
        )


@pytest.mark.parametrize("state", ALL)
def test_plan_only_when_submitted_or_queued(state: str) -> None:
    if state in ("SUBMITTED", "QUEUED"):
        job = job_in(state)
        job.record_plan({})
        assert job.state == JobState.PLANNED
    else:
        assert_refused(job_in(state), lambda j: j.record_plan({}))


@pytest.mark.parametrize("state", ALL)
def test_queue_only_when_submitted(state: str) -> None:
    job = job_in(state)
    if state == "SUBMITTED":
        job.enqueue(3, "every slot is taken")
        assert job.state == JobState.QUEUED
        assert code_of(job.collect_events()[-1]) == "JOB_QUEUED"
    else:
        assert_refused(job, lambda j: j.enqueue(1, "again"))


def test_queue_position_starts_at_one() -> None:
    with pytest.raises(InvalidCommand):
        job_in("SUBMITTED").enqueue(0, "x")


def test_a_queued_job_can_be_cancelled_or_time_out() -> None:
    job_in("QUEUED").cancel("client disconnected while queued")
    job = job_in("QUEUED")
    assert job.fail("waited 120 s in the queue", "queue_timeout") == "setup"


@pytest.mark.parametrize("state", ALL)
def test_replan_only_before_execution(state: str) -> None:
    job = job_in(state)
    if state in ("PLANNED", "DISPATCHED"):
        job.replan({"primary": "m"}, "worker lost", "n")
        assert job.state == JobState.PLANNED
        assert job.excluded_nodes == ["n"]
    else:
        assert_refused(job, lambda j: j.replan({}, "x"))


def test_replans_are_bounded() -> None:
    job = job_in("PLANNED")
    for i in range(MAX_REPLANS):
        job.replan({"n": i}, "again")
    assert_refused(job, lambda j: j.replan({}, "once more"))


@pytest.mark.parametrize("state", ALL)
def test_dispatch_validate_order(state: str) -> None:
    job = job_in(state)
    if state != "PLANNED":
        assert_refused(job, lambda j: j.dispatch(["n"]))
    if state != "DISPATCHED":
        assert_refused(job, lambda j: j.validate_setup())


def test_dispatch_needs_nodes() -> None:
    with pytest.raises(InvalidCommand):
        job_in("PLANNED").dispatch([])


@pytest.mark.parametrize("state", ["SUBMITTED", "QUEUED", "PLANNED", "DISPATCHED"])
def test_no_tokens_or_completion_before_execution(state: str) -> None:
    job = job_in(state)
    assert_refused(job, lambda j: j.record_chunk([{"seq": 0, "text": "a", "tokens": 1}]))
    assert_refused(
        job,
        lambda j: j.complete(
            finish_reason="stop",
            prompt_tokens=1,
            completion_tokens=1,
            time_to_first_token_ms=1,
            tokens_per_second=1,
        ),
    )


def test_chunk_sequence_must_be_contiguous() -> None:
    job = job_in("RUNNING")
    with pytest.raises(InvalidCommand):
        job.record_chunk([{"seq": 5, "text": "x", "tokens": 1}])
    with pytest.raises(InvalidCommand):
        job.record_chunk([{"seq": 1, "text": "x", "tokens": 1}, {"seq": 3, "text": "y"}])
    with pytest.raises(InvalidCommand):
        job.record_chunk([])
    assert job.next_seq == 1


@pytest.mark.parametrize("state", ALL)
def test_failure_phase_follows_state(state: str) -> None:
    job = job_in(state)
    phase = job.fail("boom", "x")
    expected = "setup" if state in ("SUBMITTED", "QUEUED", "PLANNED", "DISPATCHED") else "execution"
    assert phase == expected
    assert job.failure_phase == expected
    assert job.state == JobState.FAILED


@pytest.mark.parametrize("end", ["complete", "fail", "cancel"])
def test_terminal_jobs_refuse_everything(end: str) -> None:
    job = job_in("RUNNING")
    if end == "complete":
        complete(job)
    elif end == "fail":
        job.fail("x")
    else:
        job.cancel("client went away")
    assert job.terminal
    assert_refused(job, lambda j: j.fail("again"))
    assert_refused(job, lambda j: j.cancel("again"))
    assert_refused(job, lambda j: j.record_chunk([{"seq": 1, "text": "a", "tokens": 1}]))


def test_cancel_from_any_live_state() -> None:
    for state in ALL:
        job = job_in(state)
        job.cancel("client disconnected")
        assert job.state == JobState.CANCELLED


def test_new_job_starts_submitted() -> None:
    assert new_job().state == JobState.SUBMITTED
