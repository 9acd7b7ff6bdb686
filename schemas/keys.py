"""Every Redis name tokenline uses, built in one place (as RQ's Job.key_for does)."""

from __future__ import annotations

import re

PREFIX = "tokenline"
CANCEL_TTL_SECONDS = 3600
# A worker process refreshes its heartbeat every WORKER_HEARTBEAT_INTERVAL; it counts as dead once its
# heartbeat is older than WORKER_HEARTBEAT_TTL (the API then fails the requests it was serving).
WORKER_HEARTBEAT_INTERVAL = 0.5
WORKER_HEARTBEAT_TTL = 3


def queue_name(model: str) -> str:
    """The RQ queue that one model's workers serve."""
    return f"{PREFIX}.{model}"


def worker_queue_name(model: str, process: str) -> str:
    """The RQ queue of one worker process (`<host>.<pid>`) of a model: the requests routed to it
    (app/routing.py). The worker serves it before the model's shared queue."""
    return f"{queue_name(model)}@{process}"


def queue_owner(name: str) -> tuple[str, str | None]:
    """The shared queue that queue `name` belongs to, and the worker process whose own queue it is
    (None: `name` is the shared queue)."""
    shared, at, process = name.rpartition("@")
    return (shared, process) if at else (name, None)


def worker_blocks_key(process: str) -> str:
    """Set: the keys (schemas/blocks.py) of the blocks in a worker process's prefix cache."""
    return f"{PREFIX}:blocks:{process}"


def worker_block_size_key(process: str) -> str:
    """String: the tokens per block of a worker process's KV cache, which its block keys are made of (its
    attention backend may use another size than cacheBlockSize says: flex's and the NPU's 128)."""
    return f"{PREFIX}:block_size:{process}"


def worker_load_key(model: str) -> str:
    """Hash: worker process → the requests it is serving (its batch), for routing by load."""
    return f"{PREFIX}:load:{model}"


def cancel_key(request_id: str) -> str:
    """Set (with a TTL) when the client has gone; the worker drops the request at its next step."""
    return f"{PREFIX}:cancel:{request_id}"


def reply_channel(process_id: str) -> str:
    """The pub/sub channel one API process listens on for the events of all its requests."""
    return f"{PREFIX}:reply:{process_id}"


def process_name(host: str, pid: int) -> str:
    """A worker process: `<host>.<pid>`, also its RQ worker's name (device leases and heartbeats are held in
    this name)."""
    return f"{host}.{pid}"


def worker_process(name: str) -> str:
    """The worker process (`<host>.<pid>`) behind an RQ worker name: a worker whose RQ loop was started
    again after a Redis outage registers as `<host>.<pid>.r<N>`."""
    return re.sub(r"\.r\d+$", "", name)


def device_lease_key(node: str, device_id: int) -> str:
    """Held (with a TTL) by the worker that uses accelerator `device_id` on host `node`."""
    return f"{PREFIX}:device:{node}:{device_id}"


def worker_heartbeat_key(process: str) -> str:
    """Refreshed by a live worker process (`<host>.<pid>`); it expires WORKER_HEARTBEAT_TTL after a crash."""
    return f"{PREFIX}:worker:{process}"


def live_workers_key(model: str) -> str:
    """Sorted set: the worker processes of a model, scored by their last heartbeat (ms, Redis clock)."""
    return f"{PREFIX}:live:{model}"


def admitted_key(model: str) -> str:
    """Sorted set: the requests of a model queued or running, scored by when their hold expires (ms)."""
    return f"{PREFIX}:admitted:{model}"


def metrics_key() -> str:
    """Hash: worker process → the JSON snapshot of its Prometheus metrics (workers/ops/metrics.py)."""
    return f"{PREFIX}:metrics"


def stored_item_key(scope: str, item_id: str) -> str:
    """The id of the stored response (of the API key whose digest is `scope`) that holds the item
    `item_id` in its input or output: what an `item_reference` names. It expires with the response."""
    return f"{PREFIX}:item:{scope}:{item_id}"


def stored_response_key(scope: str, response_id: str) -> str:
    """A stored response (/v1/responses, store: true) of the API key whose digest is `scope`, with its
    conversation; it expires after responsesTtl."""
    return f"{PREFIX}:response:{scope}:{response_id}"
