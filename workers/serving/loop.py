"""The engine thread: feeds the engine core what the RQ side takes and hands each step to the publisher.

Three threads meet here, through typed messages and the job table (workers/serving/inflight.py, the
one owner of the jobs in flight and their RQ records):
- the RQ worker (workers/serving/intake.py) reserves a batch slot, has the table take a job (marked
  started in RQ) and `admit`s its request;
- the engine thread owns the engine core: it reads the inbox between steps (new requests, cancels,
  an abort), runs a step (on an accelerator: launches step N + 1, then processes step N's tokens while
  the device computes), and posts its events to the publisher without waiting on Redis;
- the publisher (workers/serving/publisher.py) sends them, reads the live requests' cancel flags,
  and has the table record each ended request's job in RQ and free its slot.
The engine thread imports no RQ.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from schemas.errors import GenerationFailed, InvalidRequest
from schemas.job import Event, JobPayload
from workers.engine.core import EngineCore, Launched, StepResult
from workers.models.runner import GroupBroken
from workers.ops.metrics import WorkerMetrics
from workers.serving.inflight import JobTable

logger = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.5


@dataclass(frozen=True)
class Admit:
    payload: JobPayload


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    message: str


class Poster:
    """Where the engine thread sends each step (the publisher); a seam for tests."""

    def post(self, events: list[Event], ended: list[str], live: list[str]) -> None: ...


class EngineLoop:
    def __init__(self, core: EngineCore, jobs: JobTable) -> None:
        self.core = core
        self.jobs = jobs  # read here only for which requests are in flight
        self.inbox: queue.SimpleQueue[Admit | Cancel | AbortAll | None] = queue.SimpleQueue()
        self.poster: Poster = Poster()
        self.metrics: WorkerMetrics | None = None  # updated after each step when set
        self.draining = False
        self.fatal: str | None = None  # why the engine cannot go on (its device group broke)
        self.on_fatal: Callable[[], None] = lambda: None  # called once, from the engine thread
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self, poster: Poster) -> None:
        self.poster = poster
        self.thread.start()

    def stop(self) -> None:
        self._stopped = True
        self.inbox.put(None)
        self.thread.join(5)

    # The RQ worker's side.

    def admit(self, payload: JobPayload) -> None:
        """A request the job table took: to the engine at its next step."""
        self.inbox.put(Admit(payload))

    def drain(self) -> None:
        """Take no new jobs; those in flight run on."""
        self.draining = True

    # Anyone's side.

    def cancel(self, request_id: str) -> None:
        self.inbox.put(Cancel(request_id))

    def abort_all(self, message: str) -> None:
        self.inbox.put(AbortAll(message))

    # The engine thread.

    def _run(self) -> None:
        pending: Launched | None = None  # a step launched whose tokens are not read yet (overlap)
        while not self._stopped:
            try:
                result = self._read_inbox(block=not self.core.has_work and pending is None)
                if self.core.overlap:
                    pending = self._overlapped(pending, result)
                elif self.core.has_work:
                    result.merge(self.core.step())
                if not self.core.has_work and pending is None:
                    self.core.idle()
            except GroupBroken as exc:
                pending = None
                result = self._broken(exc)
            except Exception as exc:  # a bug outside the per-request fault handling
                logger.exception("engine step failed")
                pending = None
                result = self._failed(exc)
            if result.events or result.ended:
                self.poster.post(result.events, result.ended, list(self.core.requests))
            if self.metrics is not None:
                self.metrics.update(self.core)

    def _failed(self, exc: Exception) -> StepResult:
        """A step raised where no request's fault explains it: the scheduler's and the KV cache's
        state may be half-changed (blocks taken and not given, sequences left waiting), and a next
        step could fail again or never end. The worker stops to restart whole (its supervisor,
        compose's restart policy), as vLLM's engine stops when its core dies."""
        return self._stop(
            f"engine step failed: {type(exc).__name__}: {exc}",
            f"generation failed: {type(exc).__name__}; the worker restarts.",
        )

    def _broken(self, exc: GroupBroken) -> StepResult:
        """The device group broke: the worker restarts whole, its group with it."""
        return self._stop(str(exc), "A device of the worker's group failed; the worker restarts.")

    def _stop(self, why: str, message: str) -> StepResult:
        """Fail every request with `message` and stop the worker (once) for `why`."""
        logger.error("%s; failing %d requests and stopping", why, len(self.core.requests))
        result = StepResult(ended=list(self.core.requests))
        result.events = self.core.fail_all(message)
        if self.fatal is None:
            self.fatal = why
            self.on_fatal()
        return result

    def _overlapped(self, pending: Launched | None, result: StepResult) -> Launched | None:
        """Launch the next step, then process the last one's tokens while the device runs it (first,
        while a constrained sequence runs: its grammar must see its last token before the next mask)."""
        if pending is not None and self.core.constrained:
            result.merge(self.core.finish(pending))
            pending = None
        launched = None
        if self.core.has_work:
            launched, failed = self.core.launch()
            result.merge(failed)
        if pending is not None:
            result.merge(self.core.finish(pending))
        return launched

    def _read_inbox(self, block: bool) -> StepResult:
        result = StepResult()
        try:
            message = self.inbox.get(timeout=IDLE_WAIT_SECONDS) if block else self.inbox.get_nowait()
            while True:
                self._handle(message, result)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass
        return result

    def _handle(self, message: Admit | Cancel | AbortAll | None, result: StepResult) -> None:
        if isinstance(message, Admit):
            try:
                self.core.add_request(message.payload)
            except (ValueError, InvalidRequest) as exc:
                request_id = message.payload.request_id
                error = exc if isinstance(exc, InvalidRequest) else InvalidRequest(str(exc))
                result.events.append(Event(request_id, 0, "error", error=error.envelope()["error"]))
                result.ended.append(request_id)
                return
            logger.debug("admitted request_id=%s", message.payload.request_id)
        elif isinstance(message, Cancel):
            events = self.core.cancel(message.request_id)
            if events:
                logger.info("cancelled request_id=%s", message.request_id)
                result.events += events
                result.ended.append(message.request_id)
        elif isinstance(message, AbortAll):
            ended = list(self.core.requests)
            result.events += self.core.fail_all(message.message)
            result.ended += ended
            # Admitted but not yet read from the inbox: nothing of theirs ran.
            error = GenerationFailed(message.message).envelope()["error"]
            for request_id in set(self.jobs.ids()) - set(ended) - set(result.ended):
                result.events.append(Event(request_id, 0, "error", error=error))
                result.ended.append(request_id)
