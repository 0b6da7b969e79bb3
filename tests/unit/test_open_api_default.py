"""Whether the controller may serve /v1 as configured (issue 21, finding 9): never open to
the network unless asked for."""

from __future__ import annotations

import pytest

from infrastructure.settings import Settings, SettingsError
from interfaces.cli.main import build_parser
from interfaces.controller_main import open_api_check


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "fd00::1", "ctl.lan", ""])
def test_beyond_loopback_without_a_key_it_is_refused_unless_asked_for(host: str) -> None:
    with pytest.raises(SettingsError) as refused:
        open_api_check(Settings(host=host))
    message = str(refused.value)
    assert message.startswith(f"refusing to serve /v1 on {host} (HOST, not loopback)")
    assert "AI_API_KEY" in message and "--open-api" in message and "OPEN_API=true" in message
    assert "\n" not in message
    warning = open_api_check(Settings(host=host, open_api=True))
    assert warning is not None and "OPEN to anyone" in warning and "--open-api" in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"])
def test_on_loopback_it_is_open_to_this_machine_only_and_says_so(host: str) -> None:
    assert open_api_check(Settings(host=host)) == (
        "AI_API_KEY is not set: /v1 (the inference API) is open to anyone on this machine"
    )


@pytest.mark.parametrize("open_api", [False, True])
def test_with_a_key_nothing_is_open(open_api: bool) -> None:
    assert open_api_check(Settings(host="0.0.0.0", ai_api_key="k", open_api=open_api)) is None


def test_the_cli_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["controller", "--open-api"]).open_api is True
    assert parser.parse_args(["controller"]).open_api is False
