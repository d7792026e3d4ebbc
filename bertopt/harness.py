"""What tests and benchmarks use to run servers and brokers on this machine: a free loopback port, the processes a
started process left below it, whether a pid still runs (Linux /proc)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (a /proc scan; Linux)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name may contain spaces; fields after the closing parenthesis are fixed
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
