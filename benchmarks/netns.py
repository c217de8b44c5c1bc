"""Two network namespaces joined by a rate-limited veth pair: a slow link between two "nodes" on one machine.

Used by benchmarks/compressed.py (one gloo rank per namespace) and benchmarks/throttled_zero.py (one torchrun
per namespace). Each end of the pair gets a `tc ... tbf` token bucket on its egress, so both directions of the
link are limited; traffic between processes inside one namespace goes over that namespace's loopback route
(a packet to the namespace's own address never leaves through the veth), so it is not limited: the intra-node
link. Needs root and iproute2 (`ip`, `tc`). Namespaces are only ever created and removed by the names given
here, and creation refuses names that already exist (they may belong to someone else's run).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

# tc rates in bits per second only ("mbit"); tc would read "mb"/"mbps" as bytes, an easy factor-8 mistake.
RATE_PATTERN = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit)$")
RATE_HELP = "'none' (unthrottled) or a number followed by bit, kbit, mbit, gbit or tbit (e.g. 100mbit, 1gbit)"


@dataclass(frozen=True)
class VethPair:
    """Namespace i holds veth end i with the address {subnet}.{i + 1}/24."""

    namespaces: tuple[str, str]
    veths: tuple[str, str]
    subnet: str  # the first three octets, e.g. "10.231.77"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"


def check_rate(rate: str) -> str:
    """`rate` unchanged if tc can read it as bits per second (or it is 'none'); else a ValueError naming it."""
    if rate == "none" or RATE_PATTERN.match(rate):
        return rate
    raise ValueError(f"rate {rate!r} is not a tc rate in bits per second; valid: {RATE_HELP}")


def missing_privileges() -> str | None:
    """Why this process cannot build namespaces (not root, no `ip`/`tc`), or None when it can."""
    if os.geteuid() != 0:
        return "not root: creating network namespaces and tc limits needs root (run as root, or under sudo)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def existing_namespaces() -> set[str]:
    listed = _sh("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def remove(pair: VethPair) -> None:
    """Delete our two namespaces (their veth ends, and so the pair, go with them); missing ones are fine."""
    for ns in pair.namespaces:
        _sh("ip", "netns", "del", ns, check=False)


def set_rate(pair: VethPair, rate: str) -> None:
    """Limit (or, with 'none', unlimit) the egress of both veth ends to `rate`."""
    check_rate(rate)
    for ns, dev in zip(pair.namespaces, pair.veths):
        _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)  # none yet is fine
        if rate != "none":  # token bucket; 512 kB burst keeps a 1 Gbit/s limit reachable at the kernel's tick
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
                "latency", "100ms")


def create(pair: VethPair, rate: str = "none") -> None:
    """The two namespaces, the veth pair between them (addresses, links up, loopback up) and `rate` on both
    ends. Refuses namespace names that already exist; on a failure half-way, removes what it made."""
    check_rate(rate)
    taken = existing_namespaces() & set(pair.namespaces)
    if taken:
        raise RuntimeError(f"network namespace(s) {', '.join(sorted(taken))} already exist; if they are left over "
                           f"from an interrupted benchmark, remove them with `ip netns del NAME`")
    try:
        for ns in pair.namespaces:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", pair.veths[0], "type", "veth", "peer", "name", pair.veths[1])
        for i, (ns, dev) in enumerate(zip(pair.namespaces, pair.veths)):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{pair.address(i)}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        set_rate(pair, rate)
    except BaseException:
        remove(pair)
        raise


@contextmanager
def namespaces(pair: VethPair, rate: str = "none") -> Iterator[VethPair]:
    """`create` ... `remove`, also on an exception, Ctrl-C or SIGTERM (turned into KeyboardInterrupt here)."""
    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupted)
    try:
        create(pair, rate)
        try:
            yield pair
        finally:
            remove(pair)
    finally:
        signal.signal(signal.SIGTERM, previous)
