"""Domain errors. A guarded command that fails raises one of these and records nothing."""

from __future__ import annotations


class DomainError(Exception):
    """Base class of every rule violation in the domain."""

    code = "domain_error"


class IllegalTransition(DomainError):
    """A command was given to an aggregate in a state that does not allow it."""

    code = "illegal_transition"

    def __init__(self, aggregate: str, command: str, state: str, detail: str = "") -> None:
        self.aggregate = aggregate
        self.command = command
        self.state = state
        self.detail = detail
        message = f"{aggregate} cannot {command} while {state}"
        if detail:
            message = f"{message}: {detail}"
        super().__init__(message)


class InvalidCommand(DomainError):
    """A command's arguments are malformed (wrong sequence number, empty batch, ...)."""

    code = "invalid_command"


class SlotTaken(DomainError):
    """A node cannot take a job any more: another placement (here or in another controller)
    took its slot first, or it left service, since the plan was made. Nothing was recorded;
    placing again is the answer, not a re-plan."""

    code = "slot_taken"
