"""Putting jobs on RQ queues and flagging cancellations: the API's only writes to Redis."""

from __future__ import annotations

import logging

import redis
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from app.admission import Admission
from schemas import ledger
from schemas.config import Settings
from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import CANCEL_TTL_SECONDS, cancel_key, queue_name

logger = logging.getLogger(__name__)

RESULT_TTL_SECONDS = 600
FAILURE_TTL_SECONDS = 24 * 3600
JOB_TIMEOUT_SECONDS = 3600


class Dispatcher:
    def __init__(self, connection: redis.Redis, settings: Settings, admission: Admission) -> None:
        self.connection = connection
        self.settings = settings
        self.admission = admission
        self._queues: dict[str, Queue] = {}

    def queue(self, model: str) -> Queue:
        # One per model: a Queue asks Redis for its version (INFO) once, on its first enqueue.
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = Queue(
                queue_name(model), connection=self.connection, serializer=JSONSerializer
            )
        return queue

    def submit(self, payload: JobPayload) -> None:
        """Admit the request, then enqueue its job (the job's id is the request id; it expires if no
        worker takes it in time). Over maxLinkNum: Overloaded (429); no live worker for the model:
        NoWorker (503); nothing is queued then."""
        try:
            self.admission.admit(payload.model, payload.request_id)
            self.queue(payload.model).enqueue_call(
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
            # Whether the enqueue ran is unknown: give back a place the admission may have taken. The
            # error becomes a 503 in app/errors.py, which logs the outage once, not per request.
            self.admission.release(payload.model, payload.request_id)
            raise

    def cancel(self, request_id: str, model: str | None = None) -> None:
        """Ask the worker to drop the request: it reads the flag before a newcomer's prefill and with
        every step's events. With the request's `model`, a job still queued is also taken off its queue
        in the same round trip and cancelled in RQ (CanceledJobRegistry), so that no worker ever takes
        it; one a worker has already taken (RQ moved it off the queue) is dropped by the flag."""
        try:
            with self.connection.pipeline(transaction=False) as pipe:
                pipe.set(cancel_key(request_id), 1, ex=CANCEL_TTL_SECONDS)
                if model is not None:
                    self.queue(model).remove(request_id, pipeline=pipe)
                taken_off = pipe.execute()[1:] == [1]
            if taken_off:
                Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer).cancel()
                logger.info("request_id=%s cancelled while queued", request_id)
        except (redis.RedisError, NoSuchJobError, InvalidJobOperation) as exc:
            logger.warning("cancel failed request_id=%s: %s", request_id, exc)

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

    def fail_abandoned(self, request_id: str, reason: str) -> None:
        """Record a started job whose worker died as failed, with the reason, as RQ's own cleanup of
        abandoned jobs does (which would only run minutes later); it is not retried."""
        try:
            job = Job.fetch(request_id, connection=self.connection, serializer=JSONSerializer)
            if job.get_status() != JobStatus.STARTED:
                return
            with self.connection.pipeline() as pipe:
                ledger.fail(job, None, f"WorkerLost: {reason}", job.worker_name or "", pipe)
                pipe.execute()
        except Exception as exc:  # the client's error does not depend on this bookkeeping
            logger.warning("could not record request_id=%s as failed: %s", request_id, exc)
            return
        logger.warning("request_id=%s failed: %s", request_id, reason)
