"""An empty environment that records what is asked of it: which variables a reader of the
environment (``Settings.from_env`` above all) looks at."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from infrastructure.settings import Settings


class RecordingEnv(Mapping[str, str]):
    """An empty environment that notes every name asked of it."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def settings_variables() -> set[str]:
    """Every environment variable ``Settings.from_env`` reads from an empty environment."""
    env = RecordingEnv()
    Settings.from_env(env)
    return env.asked
