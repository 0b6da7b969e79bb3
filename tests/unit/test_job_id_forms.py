"""What a person may type for a job (application/timeline.job_id_forms)."""

from __future__ import annotations

from uuid import UUID

import pytest

from application.timeline import answer_id, job_id_forms

JOB = "1b0084b9-a3c2-4d5e-8f90-123456789abc"


@pytest.mark.parametrize(
    "typed",
    [JOB, JOB.upper(), JOB.replace("-", ""), answer_id("chatcmpl-", JOB), answer_id("cmpl-", JOB)],
)
def test_full_ids_in_every_form(typed: str) -> None:
    assert job_id_forms(typed) == (UUID(JOB), None)


@pytest.mark.parametrize(
    ("typed", "prefix"),
    [
        ("1b00", "1b00"),
        ("1b0084b9", "1b0084b9"),
        ("1b0084b9-a3", "1b0084b9-a3"),
        ("1b0084b9a3c2", "1b0084b9-a3c2"),
        ("chatcmpl-1b0084b9a3c24d", "1b0084b9-a3c2-4d"),
    ],
)
def test_beginnings_become_prefixes_of_the_dashed_id(typed: str, prefix: str) -> None:
    assert job_id_forms(typed) == (None, prefix)
    assert JOB.startswith(prefix)


@pytest.mark.parametrize("typed", ["", "1b0", "node-a", "1b0084b9%", "chatcmpl-xyz"])
def test_anything_else_names_no_job(typed: str) -> None:
    assert job_id_forms(typed) == (None, None)
