"""The config file the controller and every ``dacp`` command read (infrastructure/config_file)."""

from __future__ import annotations

import datetime as dt
import stat
import tomllib
from pathlib import Path

import pytest

from infrastructure.config_file import (
    CONFIG_KEYS,
    config_path,
    load_configuration,
    read_config,
    user_config_path,
    write_new,
)
from infrastructure.settings import SETTING_NAMES, Settings, SettingsError, default_var_dir
from tests.unit.recording_env import RecordingEnv

NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.UTC)


def test_every_setting_the_controller_reads_may_be_in_the_file() -> None:
    env = RecordingEnv()
    Settings.from_env(env)
    read = env.asked - {"HOME", "XDG_DATA_HOME"}  # where the default state directory is
    assert read == set(SETTING_NAMES)
    assert "DACP_URL" in CONFIG_KEYS


def test_the_file_is_dacp_config_then_the_users_then_the_systems(tmp_path: Path) -> None:
    system = tmp_path / "etc" / "config.toml"
    env = {"HOME": str(tmp_path / "home")}
    user = tmp_path / "home" / ".config" / "dacp" / "config.toml"
    assert user_config_path(env) == user
    assert config_path(env, system) == user  # neither exists: where the controller writes
    system.parent.mkdir(parents=True)
    system.write_text("")
    assert config_path(env, system) == system  # a system install
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert config_path(env, system) == user  # the user's own wins
    xdg = {**env, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert config_path(xdg, tmp_path / "none") == tmp_path / "xdg" / "dacp" / "config.toml"
    named = {**xdg, "DACP_CONFIG": str(tmp_path / "mine.toml")}
    assert config_path(named, system) == tmp_path / "mine.toml"


def test_the_environment_wins_key_by_key(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('DATABASE_URL = "sqlite:///a.db"\nPORT = 8100\nGRPC_INSECURE = true\n')
    env = {"DACP_CONFIG": str(path), "PORT": "9000", "DATABASE_URL": ""}
    configuration = load_configuration(env)
    assert configuration.file == path
    values = configuration.values
    assert values["PORT"] == "9000"  # the environment's
    assert values["DATABASE_URL"] == "sqlite:///a.db"  # empty in the environment: unset there
    assert values["GRPC_INSECURE"] == "true"
    settings = Settings.from_env(values)
    assert (settings.port, settings.insecure) == (9000, True)
    assert configuration.origin("PORT", env) == "environment"
    assert configuration.origin("DATABASE_URL", env) == str(path)
    assert configuration.origin("HOST", env) == "default"


def test_no_file_no_values_from_it(tmp_path: Path) -> None:
    configuration = load_configuration({"DACP_CONFIG": str(tmp_path / "absent.toml")})
    assert configuration.file is None and configuration.path == tmp_path / "absent.toml"


def test_a_bad_file_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("PORT = \n")
    with pytest.raises(SettingsError, match=f"{path} is not valid TOML"):
        read_config(path)
    path.write_text('DATABSE_URL = "x"\n')
    with pytest.raises(SettingsError, match=r"'DATABSE_URL' is not a setting.*DATABASE_URL"):
        read_config(path)
    path.write_text("PORT = [1]\n")
    with pytest.raises(SettingsError, match="PORT must be a string"):
        read_config(path)


def test_written_once_private_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "dacp" / "config.toml"
    values = {"DACP_URL": "http://127.0.0.1:8000", "ADMIN_API_KEY": 'a"b\\c'}
    assert write_new(path, values, NOW)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_config(path) == values
    assert tomllib.loads(path.read_text()) == values
    assert "2026-12-05T12:00:00Z" in path.read_text()
    assert not write_new(path, {"DACP_URL": "http://other"}, NOW)  # never rewritten
    assert read_config(path) == values


def test_the_state_directory_never_depends_on_the_current_one(tmp_path: Path) -> None:
    assert default_var_dir({"HOME": "/home/op"}) == Path("/home/op/.local/share/dacp")
    assert default_var_dir({"XDG_DATA_HOME": "/data"}) == Path("/data/dacp")
    assert Settings.from_env({"HOME": "/home/op"}).var_dir.is_absolute()
    assert Settings.from_env({"DACP_VAR_DIR": "~/x", "HOME": "/h"}).var_dir.name == "x"
