"""Which addresses a model source may be on (common/model_sources.py), the settings that widen
it and bound the file servers, and the agent's fetch limits (its flags, their arithmetic)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from agent.main import build_parser, config_from_args
from agent.models.fetch_limits import MIN_READ, FetchLimits
from agent.models.model_fetch import CHUNK
from common.model_sources import SourceRefused, check_url, parse_cidrs, refusal, resolve
from infrastructure.settings import Settings, SettingsError


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.9.9.9", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "metadata"),
        ("169.254.10.1", "link-local"),
        ("fe80::1", "link-local"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("168.63.129.16", "metadata"),
        ("0.0.0.0", "unspecified"),
        ("0.1.2.3", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("255.255.255.255", "broadcast"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "metadata"),
        ("64:ff9b::7f00:1", "loopback"),
    ],
)
def test_refused_addresses(address: str, why: str) -> None:
    reason = refusal(ipaddress.ip_address(address))
    assert reason is not None and why in reason


@pytest.mark.parametrize(
    "address", ["10.0.0.9", "192.168.1.20", "172.16.4.4", "fd12:3456::1", "8.8.8.8", "2001:db8::1"]
)
def test_the_operators_network_is_fine(address: str) -> None:
    assert refusal(ipaddress.ip_address(address)) is None


def test_an_allowed_network_lifts_the_refusal_for_it_only() -> None:
    allowed = parse_cidrs(["127.0.0.0/8", " ", "fe80::/64"])
    assert refusal(ipaddress.ip_address("127.0.0.1"), allowed) is None
    assert refusal(ipaddress.ip_address("::ffff:127.0.0.1"), allowed) is None
    assert refusal(ipaddress.ip_address("fe80::1"), allowed) is None
    assert refusal(ipaddress.ip_address("169.254.169.254"), allowed) is not None
    assert refusal(ipaddress.ip_address("::1"), allowed) is not None


def test_a_malformed_network_is_named() -> None:
    with pytest.raises(ValueError, match="MODEL_SOURCE_ALLOWED_CIDRS: 'nope' is not a network"):
        parse_cidrs(["10.0.0.0/8", "nope"])


def test_check_url_resolves_and_refuses_with_the_way_out() -> None:
    for url in ("http://localhost:8080/m.gguf", "http://2130706433/m.gguf", "https://[::1]/x"):
        with pytest.raises(SourceRefused, match=r"loopback.*MODEL_SOURCE_ALLOWED_CIDRS"):
            check_url(url)
    with pytest.raises(SourceRefused, match="metadata"):
        check_url("http://METADATA.google.internal./computeMetadata/v1/")
    with pytest.raises(SourceRefused, match="metadata"):  # whatever the operator allows
        check_url("http://metadata.google.internal/", parse_cidrs(["0.0.0.0/0", "::/0"]))
    with pytest.raises(SourceRefused, match="not a valid URL"):
        check_url("http://10.0.0.1:99999/m.gguf")
    check_url("http://10.0.0.9:8080/m.gguf")
    check_url("http://localhost:8080/m.gguf", parse_cidrs(["127.0.0.0/8", "::1/128"]))
    check_url("http://no-such-host.invalid/m.gguf")  # nodes resolve it, and check it then


def test_resolve_gives_the_checked_addresses_to_connect_to() -> None:
    host, port, addresses = resolve("https://127.0.0.1/m.gguf", parse_cidrs(["127.0.0.1/32"]))
    assert (host, port) == ("127.0.0.1", 443)
    assert [a.sockaddr[0] for a in addresses] == ["127.0.0.1"]


def test_settings_parse_and_check_the_networks_and_the_file_server_limits() -> None:
    settings = Settings.from_env({"MODEL_SOURCE_ALLOWED_CIDRS": "127.0.0.0/8, 10.1.0.0/16"})
    assert settings.model_source_allowed_cidrs == ("127.0.0.0/8", "10.1.0.0/16")
    assert Settings.from_env({}).model_source_allowed_cidrs == ()
    with pytest.raises(SettingsError, match="MODEL_SOURCE_ALLOWED_CIDRS"):
        Settings.from_env({"MODEL_SOURCE_ALLOWED_CIDRS": "127.0.0.0/33"})
    limits = Settings.from_env(
        {
            "MODEL_STORE_HANDSHAKE_TIMEOUT": "2.5",
            "MODEL_STORE_WORKERS": "3",
            "MODEL_STORE_CONNECTIONS_PER_ADDRESS": "2",
        }
    )
    assert (
        limits.model_store_handshake_timeout,
        limits.model_store_workers,
        limits.model_store_connections_per_address,
    ) == (2.5, 3, 2)
    for key in ("MODEL_STORE_WORKERS", "MODEL_STORE_CONNECTIONS_PER_ADDRESS"):
        with pytest.raises(SettingsError, match=key):
            Settings.from_env({key: "0"})
    with pytest.raises(SettingsError, match="MODEL_STORE_HANDSHAKE_TIMEOUT"):
        Settings.from_env({"MODEL_STORE_HANDSHAKE_TIMEOUT": "0"})


def test_a_read_waits_for_a_quarter_of_what_the_floor_asks_of_a_window() -> None:
    assert FetchLimits().read_size(CHUNK) == CHUNK  # 1 MiB/s over 60 s: 15 MiB a quarter
    assert FetchLimits(min_rate=64 << 10, rate_window=1.0).read_size(CHUNK) == MIN_READ
    assert FetchLimits(min_rate=1 << 20, rate_window=2.0).read_size(CHUNK) == 512 << 10
    with pytest.raises(ValueError):
        FetchLimits(rate_window=0)


def test_the_agent_takes_its_fetch_limits_from_its_flags(tmp_path: Path) -> None:
    parser = build_parser()
    defaults = config_from_args(parser.parse_args(["--data-dir", str(tmp_path)]))
    assert defaults.fetch_limits == FetchLimits()
    flags = ["--fetch-deadline", "600", "--fetch-min-rate", "64K", "--fetch-rate-window", "5"]
    config = config_from_args(parser.parse_args(["--data-dir", str(tmp_path), *flags]))
    assert config.fetch_limits == FetchLimits(deadline=600, min_rate=64 << 10, rate_window=5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--fetch-rate-window", "0"])
