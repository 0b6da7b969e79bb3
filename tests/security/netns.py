"""Network namespaces the security tests create for themselves: a namespace joined to this
one by a veth pair, with private addresses that exist only inside the test (so a server can
listen beyond loopback without touching any real network)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest


def ip(*args: str) -> None:
    """``ip ARGS`` (iproute2), which must succeed within 10 seconds."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Namespace:
    """``name`` holds ``inside`` (on its end of the veth); this namespace holds ``outside``."""

    name: str
    inside: str
    outside: str
    _host_link: str

    @classmethod
    def create(cls, subnet: int = 77) -> Namespace:
        tag = uuid.uuid4().hex[:6]
        name, host_link, ns_link = f"dacp-{tag}", f"dh{tag}", f"dn{tag}"
        inside, outside = f"10.{subnet}.{int(tag[:2], 16)}.2", f"10.{subnet}.{int(tag[:2], 16)}.1"
        ip("netns", "add", name)
        try:
            ip("link", "add", host_link, "type", "veth", "peer", "name", ns_link)
            ip("link", "set", ns_link, "netns", name)
            ip("addr", "add", f"{outside}/30", "dev", host_link)
            ip("link", "set", host_link, "up")
            ip("-n", name, "addr", "add", f"{inside}/30", "dev", ns_link)
            ip("-n", name, "link", "set", ns_link, "up")
            ip("-n", name, "link", "set", "lo", "up")
            # Everything else through this namespace: the test's other namespaces too.
            ip("-n", name, "route", "add", "default", "via", outside)
        except BaseException:
            subprocess.run(["ip", "link", "del", host_link], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            raise
        return cls(name, inside, outside, host_link)

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self._host_link], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)


def namespace_fixture(subnet: int = 77) -> Callable[..., object]:
    """A function-scoped fixture, named by the module attribute it is assigned to: a fresh
    namespace on ``10.<subnet>.*``, deleted after the test."""

    def namespace() -> Iterator[Namespace]:
        ns = Namespace.create(subnet=subnet)
        yield ns
        ns.delete()

    return pytest.fixture(namespace)
