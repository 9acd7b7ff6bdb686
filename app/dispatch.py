"""Putting jobs on RQ queues and flagging cancellations: the API's only writes to Redis.

A job goes on the queue app/routing.py chooses: the model's shared queue, or one worker's own queue
(`<shared>@<host>.<pid>`), which that worker serves first. A job left on the queue of a worker that is
no longer live (it died, or drains) is moved back to the shared queue (`rescue`): by the API while its
client waits, and by the model's live workers for any queue they find orphaned (workers/serving/routing.py).
"""

from __future__ import annotations

import contextlib
import logging

import redis
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from app.admission import Admission, live_worker_names
from app.routing import Decision, Router
from schemas import ledger
from schemas.config import Settings
from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import CANCEL_TTL_SECONDS, cancel_key, queue_name, queue_owner
from schemas.ledger import FAILURE_TTL_SECONDS, RESULT_TTL_SECONDS

logger = logging.getLogger(__name__)

JOB_TIMEOUT_SECONDS = 3600


class Dispatcher:
    def __init__(self, connection: redis.Redis, settings: Settings, admission: Admission) -> None:
        self.connection = connection
        self.settings = settings
        self.admission = admission
        self.router = Router(connection, settings)
        self.on_route = lambda model, decision: None  # the API's metrics count each decision
        self.on_withdrawn = lambda model: None  # … and each job taken off its queue before a worker took it
        self._queues: dict[str, Queue] = {}

    def queue(self, name: str) -> Queue:
        # Kept: a Queue asks Redis for its version (INFO) once, on its first enqueue. Workers' queues
        # come and go with their processes, so the cache is bounded.
        queue = self._queues.get(name)
        if queue is None:
            if len(self._queues) > 1024:
                self._queues.clear()
            queue = self._queues[name] = Queue(name, connection=self.connection, serializer=JSONSerializer)
        return queue

    def submit(self, payload: JobPayload, admitted: bool = False) -> str:
        """Admit the request (unless it was, with others), then enqueue its job (the job's id is the
        request id; it expires if no worker takes it in time) on the queue the router chooses, whose
        name it returns. Over maxLinkNum: Overloaded (429); no live worker for the model: NoWorker
        (503); nothing is queued then."""
        try:
            if not admitted:
                self.admission.admit(payload.model, payload.request_id)
            name, decision = self.router.route(payload.model, payload.prompt_token_ids, payload.cache_salt)
            self.queue(name).enqueue_call(
                JOB_FUNCTION,
                args=(payload.to_dict(),),
                job_id=payload.request_id,
                ttl=int(self.settings.queue_timeout),
                result_ttl=RESULT_TTL_SECONDS,
                failure_ttl=FAILURE_TTL_SECONDS,
                timeout=JOB_TIMEOUT_SECONDS,
                description=f"{payload.model} request",
            )
        except redis.RedisError:
            # Whether the enqueue ran is unknown: give back a place the admission may have taken, once
            # Redis answers again (not with a second wait on a Redis that just failed to). The error
            # becomes a 503 in app/errors.py, which logs the outage once, not per request.
            self.admission.release(payload.model, payload.request_id, defer=True)
            raise
        self._routed(payload, decision)
        return name

    def _routed(self, payload: JobPayload, decision: Decision) -> None:
        self.on_route(payload.model, decision)
        logger.debug(
            "route request_id=%s model=%s to=%s by=%s matched=%d/%d tokens",
            payload.request_id,
            payload.model,
            decision.worker or "shared",
            decision.by,
            decision.matched,
            decision.reusable,
        )

    def cancel(self, request_id: str, model: str | None = None, queue: str | None = None) -> None:
        """Ask the worker to drop the request: it reads the flag before a newcomer's prefill and with
        every step's events. With the request's `model` (and the worker's `queue` it was routed to), a
        job still queued is also taken off its queue in the same round trip and cancelled in RQ
        (CanceledJobRegistry, which keeps it as long as RQ keeps its job), so that no worker ever takes
        it; one a worker has already taken (RQ moved it off the queue) is dropped by the flag."""
        queues = [] if model is None else list(dict.fromkeys([queue_name(model), queue or queue_name(model)]))
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.set(cancel_key(request_id), 1, ex=CANCEL_TTL_SECONDS)
                for name in queues:
                    self.queue(name).remove(request_id, pipeline=pipe)
                taken_off = 1 in pipe.execute()[1:]
            if taken_off:
                self.on_withdrawn(model)
                logger.info("request_id=%s cancelled while queued", request_id)
                # A job left queued for queueTimeout has expired (its TTL) as the API's own timer
                # withdraws it: its id was still on the queue, and there is nothing more to cancel.
                with contextlib.suppress(NoSuchJobError):
                    job = Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer)
                    job.cancel()
                    # Past its queueTimeout, with a minute for the clocks of the API's hosts (RQ's scores).
                    ledger.forget_expired_cancels(job.origin, self.connection, self.settings.queue_timeout + 60)
        except (redis.RedisError, InvalidJobOperation) as exc:
            logger.warning("cancel failed request_id=%s: %s", request_id, exc)

    def rescue(self, request_id: str, model: str) -> bool:
        """Move the request's job, if it waits on the queue of a worker that is no longer live, to the
        front of its model's shared queue; True if this call moved it."""
        try:
            job = Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return False
        if job.get_status(refresh=False) != JobStatus.QUEUED or queue_owner(job.origin)[1] is None:
            return False
        origin = job.origin  # the rescue puts it on the shared queue, its origin from then on
        moved = ledger.rescue(self.connection, job, live_worker_names(self.connection, model))
        if moved:
            logger.warning("request_id=%s moved from %s (its worker is gone) to the shared queue", job.id, origin)
        return moved

    def off_the_queues(self, request_id: str, model: str, queue: str | None) -> bool:
        """Whether the request's job is on neither the queue it was routed to nor its model's shared
        queue (where a rescue or a draining worker puts it): a worker took it off and has not yet
        recorded its start, or died before it could. A worker's dequeue of its two queues is a BLPOP,
        which keeps no list of what it took, and a worker killed outright holds its connection for a
        moment after its death, in which Redis can still hand it a job."""
        names = dict.fromkeys([queue or queue_name(model), queue_name(model)])
        return all(self.queue(name).get_job_position(request_id) is None for name in names)

    def failure(self, request_id: str) -> str | None:
        """If the job failed in RQ, the last line of its exception, for the client's error."""
        try:
            job = Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer)
            if job.get_status() != JobStatus.FAILED:
                return None
            result = job.latest_result()
        except Exception:
            return None
        text = (result.exc_string if result else None) or ""
        return text.strip().splitlines()[-1] if text.strip() else "the job failed"

    def fail_abandoned(self, request_id: str, reason: str, status: JobStatus = JobStatus.STARTED) -> None:
        """Record a job whose worker died as failed, with the reason, as RQ's own cleanup of abandoned
        jobs does (which would only run minutes later); it is not retried. `status`: the state it died
        in (a job taken off its queue and never started is still `queued`): one that has moved on
        meanwhile is left as it is."""
        try:
            job = Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer)
            if job.get_status() != status:
                return
            with self.connection.pipeline() as pipe:
                ledger.fail(job, None, f"WorkerLost: {reason}", job.worker_name or "", pipe)
                pipe.execute()
        except Exception as exc:  # the client's error does not depend on this bookkeeping
            logger.warning("could not record request_id=%s as failed: %s", request_id, exc)
            return
        logger.warning("request_id=%s failed: %s", request_id, reason)
