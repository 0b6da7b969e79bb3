"""The contract (``common/contract.py``): the defaults both ends and the tooling read from it."""

from __future__ import annotations

from agent.agent_config import parse_controller_url
from agent.main import build_parser
from agent.runtime import job_messages
from common.contract import (
    CLIENT_ERROR_CODES,
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MODEL_STORE_PORT,
    DEFAULT_RPC_PORT,
    DEFAULT_TRANSFER_PORT,
    JobErrorCode,
)
from infrastructure.settings import Settings
from ops.local_cluster import DEFAULT_AGENTS, ClusterConfig


def test_the_default_ports_are_distinct() -> None:
    ports = (
        DEFAULT_HTTP_PORT,
        DEFAULT_GRPC_PORT,
        DEFAULT_RPC_PORT,
        DEFAULT_TRANSFER_PORT,
        DEFAULT_MODEL_STORE_PORT,
    )
    assert len(set(ports)) == len(ports)


def test_the_controller_settings_default_to_the_contract_ports() -> None:
    for settings in (Settings(), Settings.from_env({})):
        assert settings.port == DEFAULT_HTTP_PORT
        assert settings.grpc_port == DEFAULT_GRPC_PORT
        assert settings.rpc_port == DEFAULT_RPC_PORT
        assert settings.model_store_port == DEFAULT_MODEL_STORE_PORT


def test_the_agent_defaults_to_the_contract_ports() -> None:
    args = build_parser().parse_args([])
    assert args.rpc_port == DEFAULT_RPC_PORT
    assert args.transfer_port == DEFAULT_TRANSFER_PORT
    assert parse_controller_url("controller.example").port == DEFAULT_GRPC_PORT
    assert f"default port {DEFAULT_GRPC_PORT};" in " ".join(build_parser().format_help().split())


def test_the_local_cluster_defaults_to_the_contract_ports() -> None:
    config = ClusterConfig()
    assert (config.port, config.grpc_port) == (DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT)
    assert DEFAULT_AGENTS[0].rpc_port == DEFAULT_RPC_PORT


def test_every_job_error_code_has_its_own_value() -> None:
    # An enum member with another's value is silently an alias of it.
    assert len(JobErrorCode.__members__) == len({code.value for code in JobErrorCode})
    assert CLIENT_ERROR_CODES < set(JobErrorCode)


def test_the_agents_error_codes_are_the_contracts() -> None:
    names = [name for name in JobErrorCode.__members__ if hasattr(job_messages, name)]
    assert len(names) >= 12
    assert all(getattr(job_messages, name) is JobErrorCode[name] for name in names)
