"""How a worker stops: on its own request from any thread, by draining, or at once (settling what
is in flight)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.serving.beacon import Beacon
    from workers.serving.loop import EngineLoop
    from workers.serving.publisher import Publisher

logger = logging.getLogger("workers")

# After the grace period, the requests still running are failed; their error events get this long.
ABORT_FLUSH_SECONDS = 5.0


def stop_self(stop: threading.Event) -> None:
    """From any thread: stop as a SIGTERM would (RQ's loop, once running, owns that signal)."""
    stop.set()
    os.kill(os.getpid(), signal.SIGTERM)


def drain(loop: EngineLoop, publisher: Publisher, beacon: Beacon, grace: float) -> None:
    """Take no new jobs; let the running ones finish within `grace` seconds; fail what is left."""
    loop.drain()
    beacon.serving = False  # alive, so the API keeps waiting, but no longer admitting for this worker
    logger.info("draining: %d requests in flight, %gs grace", len(loop.jobs), grace)
    if not wait_idle(loop, time.monotonic() + grace):
        logger.warning("grace period over: failing %d requests still running", len(loop.jobs))
        loop.abort_all("The worker shut down before this request finished.")
    settle(loop, publisher, beacon, ABORT_FLUSH_SECONDS)


def settle(loop: EngineLoop, publisher: Publisher, beacon: Beacon, timeout: float) -> None:
    """Wait for the last events to go out, then leave the live set."""
    deadline = time.monotonic() + timeout
    wait_idle(loop, deadline)
    loop.stop()
    publisher.flush(max(0.0, deadline - time.monotonic()))
    publisher.stop()
    beacon.stop()
    logger.info("stopped")


def wait_idle(loop: EngineLoop, deadline: float) -> bool:
    """Until no request is in flight (True) or the deadline (time.monotonic()) passes (False)."""
    while len(loop.jobs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not len(loop.jobs)
