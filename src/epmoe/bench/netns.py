"""An emulated cluster on one machine: Linux network namespaces joined by a shaped veth pair.

Each "node" is a network namespace of its own (a separate TCP stack); node 0's and node 1's are joined
by a veth pair, every link shaped by a token bucket (``tc qdisc ... tbf``): the veth ends at the rate
between nodes, each namespace's loopback (what ranks of one node talk over) at the rate inside a
node. The kernel holds the bytes back, so the CPU stays free for compute, as on a real cluster::

    namespace <tag>-n0                                namespace <tag>-n1
    ranks 0, 1 --lo (inside)--> 10.<a>.<b>.1 ==veth (between)== 10.<a>.<b>.2 <--lo (inside)-- ranks 2, 3

:class:`EmulatedCluster` creates all of it on entry and removes all of it on exit, also when the body
raises or is interrupted (Ctrl-C; SIGTERM is turned into the same exit): the namespaces (deleting one
deletes its end of the veth pair and the other end with it) and nothing else. It needs root and
iproute2's ``ip`` and ``tc``: :func:`unavailable` says why it cannot run where it cannot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

_CHECK_TIMEOUT_S = 20


def unavailable() -> str | None:
    """Why an emulated cluster cannot be made here, ``None`` where it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces and tc need root (this process is not root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2's {' and '.join(missing)} not found on PATH"
    probe = f"epmoe-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=_CHECK_TIMEOUT_S)
    return None


@dataclass(frozen=True)
class Link:
    """A token-bucket shape: ``mbit`` megabits per second (``None``: unshaped)."""

    mbit: float | None

    def qdisc(self, device: str) -> list[str] | None:
        """The ``tc`` command shaping ``device``'s egress, ``None`` where unshaped. The bucket holds at
        least 10 ms of the rate and two 64 KiB frames (loopback's MTU), so the rate is reached."""
        if self.mbit is None:
            return None
        rate_bytes = self.mbit * 1e6 / 8
        burst = max(int(rate_bytes / 100), 2 * 65536 + 4096)
        return ["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{self.mbit}mbit",
                "burst", str(burst), "latency", "200ms"]  # fmt: skip


class EmulatedCluster:
    """Two nodes on this machine (see the module docstring). Use as a context manager::

        with EmulatedCluster(between=Link(80), inside=Link(600)) as cluster:
            procs = [cluster.popen(node, argv, env=...) for node in range(2)]

    ``cluster.address(node)`` is the node's address on the veth pair (node 0's is the rendezvous
    host); ``cluster.device(node)`` its veth device (``GLOO_SOCKET_IFNAME``); processes started by
    :meth:`popen` run inside the node's namespace."""

    NODES = 2

    def __init__(self, between: Link = Link(None), inside: Link = Link(None), *, tag: str | None = None):
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(f"EmulatedCluster: {reason}")
        self.between, self.inside = between, inside
        tag = tag or f"epmoe{os.getpid() % 100000}"
        if len(tag) > 12:  # a device name holds at most 15 characters: the tag, "v", the node
            raise ValueError(f"EmulatedCluster(tag): at most 12 characters, got {tag!r}")
        self.tag = tag
        self.namespaces = [f"{tag}-n{node}" for node in range(self.NODES)]
        subnet = 1 + os.getpid() % 250
        self.addresses = [f"10.77.{subnet}.{node + 1}" for node in range(self.NODES)]
        self._made: list[str] = []
        self._previous_sigterm = None

    def address(self, node: int) -> str:
        return self.addresses[node]

    def device(self, node: int) -> str:
        return f"{self.tag}v{node}"

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace (``subprocess.Popen`` keyword arguments)."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], **kwargs)

    def __enter__(self) -> EmulatedCluster:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._create()
        except BaseException:
            self._remove()
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self._remove()
        finally:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _create(self) -> None:
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
            self._made.append(namespace)
            self._in(namespace, "ip", "link", "set", "lo", "up")
        a, b = self.device(0), self.device(1)
        _ip(
            "link",
            "add",
            a,
            "netns",
            self.namespaces[0],
            "type",
            "veth",
            "peer",
            "name",
            b,
            "netns",
            self.namespaces[1],
        )
        for node, namespace in enumerate(self.namespaces):
            device = self.device(node)
            self._in(namespace, "ip", "addr", "add", f"{self.addresses[node]}/24", "dev", device)
            self._in(namespace, "ip", "link", "set", device, "up")
            for link, shaped in ((self.between, device), (self.inside, "lo")):
                command = link.qdisc(shaped)
                if command is not None:
                    self._in(namespace, *command)

    def _remove(self) -> None:
        """Delete every namespace this cluster made (the veth pair goes with them); never raises."""
        while self._made:
            namespace = self._made.pop()
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=_CHECK_TIMEOUT_S)

    def _in(self, namespace: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", namespace, *argv])

    def leftovers(self) -> list[str]:
        """Namespaces or devices of this cluster's tag still present on the machine (none after exit)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S)
        found = [line.split()[0] for line in names.stdout.splitlines() if line.startswith(self.tag + "-")]
        return found + [line.split(":")[1].strip() for line in links.stdout.splitlines() if f" {self.tag}v" in line]


def _ip(*argv: str) -> None:
    _run(["ip", *argv])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_CHECK_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"EmulatedCluster: `{' '.join(argv)}` failed: {done.stderr.strip()}")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
