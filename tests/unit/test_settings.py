"""Controller settings from the environment: defaults and clear refusals."""

from __future__ import annotations

import pytest

from infrastructure.settings import Settings, SettingsError


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.token_record_interval == 1.0
    assert settings.queue_timeout == 120.0 and settings.queue_max == 512


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TOKEN_RECORD_INTERVAL": "0"}, "TOKEN_RECORD_INTERVAL must be positive"),
        ({"QUEUE_MAX": "0"}, "QUEUE_MAX must be at least 1"),
        ({"QUEUE_MAX": "many"}, "QUEUE_MAX must be an integer"),
        ({"DEGRADED_AFTER": "20"}, "OFFLINE_AFTER (15.0) must exceed DEGRADED_AFTER (20.0)"),
    ],
)
def test_bad_values_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    assert message in str(refused.value)
