"""gRPC core's own stderr lines are off unless asked for (wire/grpc_verbosity.py)."""

from __future__ import annotations

import pytest

from wire.grpc_verbosity import (
    AGENT_VERBOSITY,
    CONTROLLER_VERBOSITY,
    DEBUG_VERBOSITY,
    set_grpc_verbosity,
)


@pytest.mark.parametrize("quiet", [AGENT_VERBOSITY, CONTROLLER_VERBOSITY])
def test_quiet_unless_debug_is_asked_for(quiet: str) -> None:
    environ: dict[str, str] = {}
    assert set_grpc_verbosity(quiet, debug=False, environ=environ, imported=()) == quiet
    assert environ == {"GRPC_VERBOSITY": quiet}
    environ = {}
    assert set_grpc_verbosity(quiet, debug=True, environ=environ, imported=()) == "DEBUG"
    assert environ == {"GRPC_VERBOSITY": DEBUG_VERBOSITY}


@pytest.mark.parametrize(
    "operator", [{"GRPC_VERBOSITY": "INFO"}, {"GRPC_TRACE": "tcp"}, {"GRPC_VERBOSITY": ""}]
)
def test_the_operators_own_choice_is_kept(operator: dict[str, str]) -> None:
    environ = dict(operator)
    assert set_grpc_verbosity(AGENT_VERBOSITY, debug=True, environ=environ, imported=()) is None
    assert environ == operator


def test_nothing_is_set_once_grpc_is_imported() -> None:
    """Too late to matter here; it would only leak into child processes."""
    environ: dict[str, str] = {}
    assert (
        set_grpc_verbosity(AGENT_VERBOSITY, debug=False, environ=environ, imported={"grpc"}) is None
    )
    assert environ == {}
