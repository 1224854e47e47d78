"""Processes the server tests start and must see gone: a free port, /proc reads, a process tree, what outlives it.

A process is followed by (pid, start time), so a pid the kernel reuses for something else is never mistaken for
the one a test started.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process, or None (gone, or a zombie: it has exited)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name (in parentheses) may hold spaces
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]), int(fields[19]))


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (start time, name) of every live process below ``root``."""
    stats = {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := proc_stat(int(e))) is not None}
    found: dict[int, tuple[int, str]] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, st in stats.items() if st[1] in frontier and pid not in found}
        for pid in frontier:
            try:
                found[pid] = (stats[pid][2], Path(f"/proc/{pid}/comm").read_text().strip())
            except OSError:
                pass
    return found


def _alive(pid: int, start: int) -> bool:
    return (st := proc_stat(pid)) is not None and st[2] == start


def still_running(seen: dict[int, tuple[int, str]], grace_s: float) -> list[str]:
    """Which of ``seen`` (``descendants``' map) still run, as "pid (name)", after up to ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [f"{pid} ({name})" for pid, (start, name) in seen.items() if _alive(pid, start)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_left(seen: dict[int, tuple[int, str]]) -> None:
    """SIGKILL whatever of ``seen`` still runs (a failed test's clean-up)."""
    for pid, (start, _) in seen.items():
        if _alive(pid, start):
            os.kill(pid, signal.SIGKILL)


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, log: Callable[[], str]) -> None:
    """Until ``GET /health`` answers 200; fails with the server's log (``log()``) if it exits or takes longer."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log()}"
        assert time.monotonic() < deadline, f"not healthy after {timeout_s:.0f} s:\n{log()}"
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
