"""Putting jobs on RQ queues and flagging cancellations: the API's only writes to Redis."""

from __future__ import annotations

import logging
from typing import Any

import redis
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from app.admission import ADMIT_AND_PUSH, Admission, Hold
from schemas.config import Settings
from schemas.errors import ServiceUnavailable
from schemas.job import JOB_FUNCTION, JobPayload
from schemas.keys import CANCEL_TTL_SECONDS, cancel_key, queue_name

logger = logging.getLogger(__name__)

RESULT_TTL_SECONDS = 600
FAILURE_TTL_SECONDS = 24 * 3600
JOB_TIMEOUT_SECONDS = 3600


class AdmittingQueue(Queue):
    """An RQ queue whose push of an admitted request's job id is the admission script (ADMIT_AND_PUSH).

    RQ's enqueue writes the job's hash and then pushes its id (`push_job_id`), in the enqueue's
    transaction; here the push is conditional on admission, and a refused job's hash is deleted in the
    same transaction, so no worker ever sees it. Admission thus costs no round trip of its own (in a
    lone request's path, admission and enqueue took 0.79 ms together against 0.36 + 0.54 ms apart).
    Any other push (none in the API) is RQ's own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holds: dict[str, Hold] = {}  # by job id, from `Dispatcher.submit` to the push

    def push_job_id(self, job_id: str, pipeline: Any = None, at_front: bool = False) -> None:
        hold = self.holds.pop(job_id, None)
        if hold is None or pipeline is None or at_front:
            super().push_job_id(job_id, pipeline=pipeline, at_front=at_front)
            return
        hold.at = len(pipeline)
        keys = [*hold.keys, self.key, self.job_class.key_for(job_id)]
        pipeline.eval(ADMIT_AND_PUSH, len(keys), *keys, *hold.args)


class Dispatcher:
    def __init__(self, connection: redis.Redis, settings: Settings, admission: Admission) -> None:
        self.connection = connection
        self.settings = settings
        self.admission = admission
        self._queues: dict[str, AdmittingQueue] = {}

    def queue(self, model: str) -> AdmittingQueue:
        # One per model: a Queue asks Redis for its version (INFO) once, on its first enqueue.
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = AdmittingQueue(
                queue_name(model), connection=self.connection, serializer=JSONSerializer
            )
        return queue

    def submit(self, payload: JobPayload) -> None:
        """Admit and enqueue the request, in one round trip; the job's id is the request id, and it
        expires if no worker takes it in time. Over maxLinkNum: Overloaded (429); no live worker for
        the model: NoWorker (503); nothing is queued then."""
        queue = self.queue(payload.model)
        hold = queue.holds[payload.request_id] = self.admission.hold(payload.model, payload.request_id)
        try:
            with self.connection.pipeline() as pipe:
                queue.enqueue_call(
                    JOB_FUNCTION,
                    args=(payload.to_dict(),),
                    job_id=payload.request_id,
                    ttl=int(self.settings.queue_timeout),
                    result_ttl=RESULT_TTL_SECONDS,
                    failure_ttl=FAILURE_TTL_SECONDS,
                    timeout=JOB_TIMEOUT_SECONDS,
                    description=f"{payload.model} request",
                    pipeline=pipe,
                )
                replies = pipe.execute()
        except redis.RedisError as exc:
            logger.warning("enqueue failed request_id=%s: %s", payload.request_id, exc)
            # Whether the transaction ran is unknown: give back a place it may have taken.
            self.admission.release(payload.model, payload.request_id)
            raise ServiceUnavailable("The queue (Redis) is unavailable; try again shortly.") from None
        finally:
            queue.holds.pop(payload.request_id, None)
        if hold.at is None:
            raise RuntimeError("RQ enqueued the job without pushing it through AdmittingQueue.push_job_id")
        self.admission.settle(hold, replies[hold.at])

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
            registry = StartedJobRegistry(job.origin, connection=self.connection, serializer=JSONSerializer)
            executions = [
                f"{jid}:{eid}" for jid, eid in registry.get_job_and_execution_ids(cleanup=False) if jid == job.id
            ]
            with self.connection.pipeline() as pipe:
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                job._handle_failure(f"WorkerLost: {reason}", pipe, worker_name=job.worker_name or "")
                if executions:
                    pipe.zrem(registry.key, *executions)
                pipe.execute()
        except Exception as exc:  # the client's error does not depend on this bookkeeping
            logger.warning("could not record request_id=%s as failed: %s", request_id, exc)
            return
        logger.warning("request_id=%s failed: %s", request_id, reason)
