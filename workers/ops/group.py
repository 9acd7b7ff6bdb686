"""A tensor-parallel worker's other ranks: rank 0 starts them, watches them and stops them.

The group lives and dies as one unit. Rank 0 (`python -m workers`, the process a supervisor or an
orchestrator runs) starts ranks 1..N-1 as its children, which set PR_SET_PDEATHSIG first thing, so that
they die with it however it ends; it watches them, and when one exits it fails the group's requests and exits
itself (non-zero), so that what restarts a worker restarts the whole group. The ranks ignore SIGINT and
SIGTERM: they leave when rank 0 tells them to, or die with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
LEADER_ENV = "TOKENLINE_GROUP_LEADER"  # rank 0's pid, in its followers' environment
POLL_SECONDS = 0.1


def die_with_leader() -> None:
    """In a follower rank, first thing: SIGKILL when rank 0 dies, and exit at once if it already has
    (set here rather than in a preexec_fn: rank 0 has threads when it starts the ranks)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if str(os.getppid()) != os.environ.get(LEADER_ENV):
        os._exit(1)


def free_address(host: str = "127.0.0.1") -> str:
    """A rendezvous address for the group's ranks on this host."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"


def ignore_stop_signals() -> None:
    """A follower rank leaves when rank 0 says so, not on the terminal's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Followers:
    """Ranks 1..world-1, started as `python -m workers <argv> --rank R --world W --group-address A`."""

    def __init__(self, processes: dict[int, subprocess.Popen[bytes]]) -> None:
        self.processes = processes
        self._leaving = threading.Event()

    @classmethod
    def start(cls, world: int, argv: list[str], address: str, devices: list[str]) -> Followers:
        """`devices[r]` is rank r's torch device."""
        processes = {}
        for rank in range(1, world):
            command = [sys.executable, "-m", "workers", *argv, "--device", devices[rank]]
            command += ["--rank", str(rank), "--world", str(world), "--group-address", address]
            processes[rank] = subprocess.Popen(command, env={**os.environ, LEADER_ENV: str(os.getpid())})
        logger.info(
            "started ranks %s of the device group (pids %s)",
            ", ".join(map(str, processes)),
            ", ".join(str(p.pid) for p in processes.values()),
        )
        return cls(processes)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values()]

    def exited(self) -> str | None:
        """Which rank has exited, if one has (while the group starts: models/parallel.py rendezvous)."""
        for rank, process in self.processes.items():
            status = process.poll()
            if status is not None:
                return f"rank {rank} exited (status {status}) before the group formed"
        return None

    def watch(self, on_lost: Callable[[int, int], None]) -> None:
        """From a daemon thread: `on_lost(rank, status)` once, when a rank exits while the group serves."""

        def run() -> None:
            while not self._leaving.wait(POLL_SECONDS):
                for rank, process in self.processes.items():
                    status = process.poll()
                    if status is not None and not self._leaving.is_set():
                        on_lost(rank, status)
                        return

        threading.Thread(target=run, name="group-watch", daemon=True).start()

    def leaving(self) -> None:
        """From now on an exit is expected (rank 0 is about to tell the ranks to leave)."""
        self._leaving.set()

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the ranks to leave (rank 0 told them to), then kill them."""
        self._leaving.set()
        deadline = time.monotonic() + timeout
        for rank, process in self.processes.items():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("rank %d did not leave; killing it", rank)
                process.kill()
                process.wait()
