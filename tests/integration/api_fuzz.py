"""Schemathesis against the controller's own OpenAPI schema, case by case.

Used by :mod:`tests.integration.test_api_fuzz`. Every documented operation is fuzzed with
positive (schema-valid) and negative (schema-violating) data, each with the right key, with no
key and with a wrong one, over real HTTP. Failures are collected per run (operation, data
mode, key) instead of stopping at the first, so one run shows every problem; the cases that
were actually sent are counted, so a schema that quietly yields fewer cases is noticed.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import CheckContext
from schemathesis.core.failures import Failure
from schemathesis.core.result import Err
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from interfaces.http.admin.admin_api import INVALID_NODE_NAME
from interfaces.http.admin.models_api import SOURCE_REFUSED
from interfaces.http.openai.openai_fields import INVALID_COMBINATION

AI_KEY = "test-ai-key"
ADMIN_KEY = "test-admin-key"
#: Paths anyone may call (the others need a bearer key; see tests/unit/test_openapi_schema.py).
PUBLIC = frozenset({"/health", "/metrics"})
#: Seconds one request may take; the SSE feed is read up to its first event (``ready``).
REQUEST_TIMEOUT = 10.0


class ServerError(Failure):
    """A 5xx response other than a 503 that tells the client when to retry."""

    code = "DACP500"
    checks = ("not_a_server_error_unless_retry_after",)
    kind_title = "Server error"


class KeyMisjudged(Failure):
    """A secured operation answered a request without the right key with something other
    than 401/403, or refused the right key."""

    code = "DACP401"
    checks = ("keys_are_enforced",)
    kind_title = "Key misjudged"


def not_a_server_error_unless_retry_after(
    ctx: CheckContext, response: schemathesis.Response, case: Case[Any]
) -> bool | None:
    """Schemathesis' ``not_a_server_error``, except that a 503 with ``Retry-After`` is the
    controller's documented "busy, retry shortly" (no capacity, queue full, store outage)."""
    if response.status_code < 500:
        return None
    if response.status_code == 503 and response.headers.get("retry-after"):
        return None
    raise ServerError(
        operation=case.operation.label,
        title="Server error",
        message=f"Received {response.status_code}: {response.content[:500]!r}",
    )


def valid_data_accepted(
    ctx: CheckContext, response: schemathesis.Response, case: Case[Any]
) -> bool | None:
    """Schemathesis' ``positive_data_acceptance``, except for a 400 ``invalid_combination``:
    two fields that each match the schema but disagree in a way JSON Schema cannot say (a
    ``tool_choice`` naming a function not among ``tools``, ``top_logprobs`` without
    ``logprobs``; see :mod:`interfaces.http.openai.openai_docs`), and a 400 ``source_refused``: a
    model source URL whose host is not a host, or resolves to an address sources may not be on
    (:mod:`common.model_sources`), which no pattern can say; and a 400 ``invalid_node_name``:
    a token's node name with a character no node name may hold (letters and digits of any
    script, ``.``, ``_``, ``-``: :func:`domain.bounded_text.node_name_problem`)."""
    if response.status_code == 400:
        try:
            code = json.loads(response.content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code in (INVALID_COMBINATION, SOURCE_REFUSED, INVALID_NODE_NAME):
            return None
    return positive_data_acceptance(ctx, response, case)


#: Schemathesis' checks of one response, with our 5xx rule in place of ``not_a_server_error``
#: (and :func:`keys_enforced`, per key). Left out, as they cannot apply to these cases:
#: ``use_after_free``, ``ensure_resource_availability`` and ``object_level_authorization``
#: need its stateful phase (chains of calls, several identities); ``missing_required_header``
#: and ``unsupported_method`` act on its coverage phase's probes only; ``allow_header_conformance``
#: on OPTIONS requests only; ``ignored_auth`` re-sends every request without the key, which
#: the runs with a missing and a wrong key already do; ``max_response_time`` has no limit set.
CHECKS: list[Callable[..., bool | None]] = [
    not_a_server_error_unless_retry_after,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    valid_data_accepted,
]


@dataclass(frozen=True)
class Key:
    """How a case authenticates: ``valid``, ``missing`` or ``wrong``."""

    name: str
    headers: Callable[[str], dict[str, str]]


def _right_key(path: str) -> str:
    return AI_KEY if path.startswith("/v1/") else ADMIN_KEY


def _wrong_key(path: str) -> str:
    # The other API's key: valid somewhere, so this also checks the two keys stay apart.
    return ADMIN_KEY if path.startswith("/v1/") else AI_KEY


KEYS = (
    Key("valid", lambda path: {"Authorization": f"Bearer {_right_key(path)}"}),
    Key("missing", lambda path: {}),
    Key("wrong", lambda path: {"Authorization": f"Bearer {_wrong_key(path)}"}),
)


def keys_enforced(key: Key) -> Callable[..., bool | None]:
    """A check: secured operations answer 401/403 to a missing or wrong key, and never to
    the right one."""

    def check(ctx: CheckContext, response: schemathesis.Response, case: Case[Any]) -> None:
        status = response.status_code
        if case.operation.path in PUBLIC:
            return
        if key.name == "valid" and status in (401, 403):
            problem = f"The right key was refused with {status}"
        elif key.name != "valid" and status not in (401, 403):
            problem = f"A request with a {key.name} key got {status}, not 401 or 403"
        else:
            return
        raise KeyMisjudged(operation=case.operation.label, title="Key misjudged", message=problem)

    return check


@dataclass
class FuzzReport:
    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def summary(self) -> str:
        lines = [f"{self.total} cases in {self.seconds:.1f} s"]
        for label, count in sorted(self.cases.items()):
            statuses = sorted((s, n) for (op, s), n in self.statuses.items() if op == label)
            lines.append(f"  {count:4d}  {label}  {dict(statuses)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Budget:
    """Examples per operation and run: the right key gets most, the rejected keys fewer
    (the guard answers before anything else runs, so a few show it holds)."""

    valid: int
    rejected: int

    def for_key(self, key: Key) -> int:
        return self.valid if key.name == "valid" else self.rejected


#: Real values by parameter name (``node_id``, ``job_id``, ``model``...): drawn ids almost
#: never exist, so valid cases name a real node, job or model half the time, and the success
#: answers are checked against the schema too, not only the 404s.
Known = Mapping[str, Sequence[str]]


def with_known_values(case: Case[Any], known: Known) -> st.SearchStrategy[Case[Any]]:
    """``case``, or a copy naming real things in its path, query or top-level body fields."""
    slots = [
        (container, name)
        for container in (case.path_parameters, case.query, case.body)
        if isinstance(container, dict)
        for name in container
        if known.get(name)
    ]
    if not slots:
        return st.just(case)

    def pick(choices: list[str | None]) -> Case[Any]:
        for (container, name), value in zip(slots, choices, strict=True):
            if value is not None:
                container[name] = value
        return case

    return st.tuples(*(st.sampled_from([None, *known[name]]) for _, name in slots)).map(
        lambda choices: pick(list(choices))
    )


def _constrained(parameter: Any) -> bool:
    """Whether some value breaks the parameter's schema (any string is a model's name)."""
    schema = dict(parameter.definition.get("schema") or {})
    schema.pop("description", None)
    return schema != {"type": "string"}


def modes(operation: Any) -> tuple[GenerationMode, ...]:
    """Both data modes; only valid data for an operation whose input cannot be made invalid
    (no parameters and no body, or only free strings such as ``/v1/models/{model}``)."""
    parameters = list(operation.iter_parameters())
    takes_input = any(_constrained(p) for p in parameters) or len(operation.body) > 0
    if takes_input:
        return (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    return (GenerationMode.POSITIVE,)


def load_schema(base_url: str) -> schemathesis.BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "generation": {
                # Keys are sent by the harness, one way per run (right, missing, wrong).
                "with-security-parameters": False,
            },
            "checks": {
                # Invalid data must be refused as invalid: schemathesis also lets 5xx pass
                # here, and a 503 with Retry-After passes our own 5xx rule.
                "negative_data_rejection": {"expected-statuses": [400, 401, 403, 404, 409, 413]},
            },
            "max-stream-events": 1,
            "request-timeout": REQUEST_TIMEOUT,
            # Only the key is hidden in failure reports: its default list also hides body
            # fields such as max_tokens ("token"), which made reproductions useless.
            "output": {
                "sanitization": {"keys-to-sanitize": ["authorization"], "sensitive-markers": []}
            },
        }
    )
    return schemathesis.openapi.from_url(f"{base_url}/schema/openapi.json", config=config)


def fuzz(base_url: str, budget: Budget, known: Known) -> FuzzReport:
    """Runs every operation of the served schema in both data modes with each key."""
    schema = load_schema(base_url)
    report = FuzzReport()
    started = time.monotonic()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            if isinstance(result, Err):  # the served schema does not even load: report it
                raise result.err()
            operation = result.ok()
            for mode in modes(operation):
                for key in KEYS:
                    _fuzz_one(operation, mode, key, budget, base_url, session, report, known)
    report.seconds = time.monotonic() - started
    return report


def _fuzz_one(
    operation: Any,
    mode: GenerationMode,
    key: Key,
    budget: Budget,
    base_url: str,
    session: requests.Session,
    report: FuzzReport,
    known: Known,
) -> None:
    label = f"{operation.label} [{mode.value}, {key.name} key]"
    headers = key.headers(operation.path)
    checks = [*CHECKS, keys_enforced(key)]
    strategy: st.SearchStrategy[Case[Any]] = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:  # a negative case may be invalid in that very field
        strategy = strategy.flatmap(lambda case: with_known_values(case, known))

    @settings(
        max_examples=budget.for_key(key),
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @given(case=strategy)
    def run(case: Case[Any]) -> None:
        report.cases[label] += 1
        response = case.call(base_url=base_url, session=session, headers=headers)
        report.statuses[(label, response.status_code)] += 1
        case.validate_response(response, checks=checks, headers=headers)

    try:
        run()
    # Schemathesis' FailureGroup is a BaseExceptionGroup. Every run's first failure is kept.
    except (Exception, BaseExceptionGroup) as e:
        report.failures[label] = f"{type(e).__name__}: {e}"
