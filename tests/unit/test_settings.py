"""Controller settings from the environment: defaults and clear refusals."""

from __future__ import annotations

import pytest

from application.deadlines import Deadlines
from infrastructure.settings import Settings, SettingsError


def test_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.token_record_interval == 1.0
    assert settings.queue_timeout == 120.0 and settings.queue_max == 512
    assert settings.deadlines() == Deadlines(first_token=300.0, stream_idle=60.0, request=0.0)


def test_open_api_and_the_feed_session_from_the_environment() -> None:
    defaults = Settings.from_env({})
    assert defaults.open_api is False and defaults.feed_session_seconds == 900.0
    given = Settings.from_env({"OPEN_API": "true", "FEED_SESSION_SECONDS": "30"})
    assert given.open_api is True and given.feed_session_seconds == 30.0


@pytest.mark.parametrize("off", ["0", "off", "false", "OFF"])
def test_prefix_routing_is_on_unless_turned_off(off: str) -> None:
    assert Settings.from_env({}).prefix_routing is True
    assert Settings.from_env({"PREFIX_ROUTING": "on"}).prefix_routing is True
    assert Settings.from_env({"PREFIX_ROUTING": off}).prefix_routing is False


def test_fair_queueing_is_on_unless_turned_off() -> None:
    assert Settings.from_env({}).fair_queueing is True
    assert Settings.from_env({"FAIR_QUEUEING": "off"}).fair_queueing is False


def test_deadlines_from_the_environment() -> None:
    env = {"FIRST_TOKEN_TIMEOUT": "20", "STREAM_IDLE_TIMEOUT": "5", "REQUEST_TIMEOUT": "600"}
    assert Settings.from_env(env).deadlines() == Deadlines(20.0, 5.0, 600.0)
    assert Settings.from_env({"REQUEST_TIMEOUT": "0"}).request_timeout == 0.0  # off


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TOKEN_RECORD_INTERVAL": "0"}, "TOKEN_RECORD_INTERVAL must be positive"),
        ({"QUEUE_MAX": "0"}, "QUEUE_MAX must be at least 1"),
        ({"QUEUE_MAX": "many"}, "QUEUE_MAX must be an integer"),
        ({"DEGRADED_AFTER": "20"}, "OFFLINE_AFTER (15.0) must exceed DEGRADED_AFTER (20.0)"),
        ({"STREAM_IDLE_TIMEOUT": "0"}, "STREAM_IDLE_TIMEOUT must be positive"),
        ({"REQUEST_TIMEOUT": "-1"}, "REQUEST_TIMEOUT must be at least 0 (0: off)"),
        ({"OPEN_API": "please"}, "OPEN_API must be true or false"),
        ({"FEED_SESSION_SECONDS": "0"}, "FEED_SESSION_SECONDS must be positive"),
        ({"FEED_SESSION_SECONDS": "15m"}, "FEED_SESSION_SECONDS must be a number of seconds"),
    ],
)
def test_bad_values_are_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.from_env(env)
    assert message in str(refused.value)
