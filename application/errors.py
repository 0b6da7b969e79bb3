"""Application-level errors (the domain's are in :mod:`domain.errors`)."""

from __future__ import annotations


class ApplicationError(Exception):
    code = "application_error"


class NotFound(ApplicationError):
    code = "not_found"

    def __init__(self, kind: str, ident: object) -> None:
        self.kind = kind
        self.ident = str(ident)
        super().__init__(f"unknown {kind} {ident}")


class TokenRevoked(ApplicationError):
    code = "token_revoked"

    def __init__(self, token_id: str) -> None:
        super().__init__(f"enrollment token {token_id} was revoked")


class TokenAlreadyUsed(ApplicationError):
    code = "token_reused"

    def __init__(self, token_id: str) -> None:
        super().__init__(f"enrollment token {token_id} is single-use and was already redeemed")


class ConcurrencyExhausted(ApplicationError):
    code = "concurrency_conflict"
