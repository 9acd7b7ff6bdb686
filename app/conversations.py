"""Stored responses (/v1/responses with `store: true`) in Redis, so that any API process or replica
can retrieve one, list its input items, delete it, or continue its conversation
(`previous_response_id`).

A record holds the response object, this request's input items, and the conversation before them
(the previous response's context, input and output), so a follow-up reads one key, not a chain. Each
item of its input and output is indexed by its id (a key naming the response), so that a request's
`item_reference` finds it.
Records are scoped to the API key that made them (another key finds nothing: 404), expire after
`responsesTtl`, and a conversation larger than `responsesMaxBytes` is refused before it is queued.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from app.parsers import arguments_complete
from schemas.errors import InvalidRequest, TokenlineError
from schemas.keys import stored_item_key, stored_response_key

logger = logging.getLogger(__name__)


class ResponseNotFound(TokenlineError):
    """No stored response with that id for this API key (never stored, expired, deleted, or another
    key's): 404, in OpenAI's envelope."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


def key_scope(api_key: str) -> str:
    """The scope of a presented API key (or of none): its digest, so no key is written to Redis."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]] = field(default_factory=list)  # the conversation before the input
    queue: str | None = None  # the RQ queue of its job (a background response's cancel takes it off)
    # The reply channel of the API process that runs a background response (it alone can store its end).
    owner: str | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up continues from: the context, this input, this output, less the
        function calls the output ended inside (their arguments are not whole JSON: no client could
        have run them, and chat refuses them) and the messages it ended before any text (a run that
        failed or was cancelled at once: an empty assistant turn says nothing, and chat refuses it)."""
        return [
            *self.context,
            *self.input_items,
            *(item for item in self.response.get("output", ()) if not (_cut_call(item) or _empty_message(item))),
        ]

    def to_json(self) -> str:
        return json.dumps(
            {
                "response": self.response,
                "input_items": self.input_items,
                "context": self.context,
                "queue": self.queue,
                "owner": self.owner,
            },
            ensure_ascii=False,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: bytes) -> StoredResponse:
        data = json.loads(raw)
        return cls(data["response"], data["input_items"], data["context"], data.get("queue"), data.get("owner"))


def _empty_message(item: dict[str, Any]) -> bool:
    return item.get("type") == "message" and not any(
        part.get("text") or part.get("refusal") for part in item.get("content") or ()
    )


def _cut_call(item: dict[str, Any]) -> bool:
    return item.get("type") == "function_call" and not arguments_complete(item.get("arguments", ""))


class ResponseStore:
    def __init__(self, connection: redis.Redis, ttl: float, max_bytes: int) -> None:
        self.connection = connection
        self.ttl_ms = max(1, int(ttl * 1000))
        self.max_bytes = max_bytes

    def load(self, scope: str, response_id: str, param: str | None = None) -> StoredResponse:
        raw = self.connection.get(stored_response_key(scope, response_id))
        if raw is None:
            raise ResponseNotFound(f"Response with id '{response_id}' not found.", param=param)
        return StoredResponse.from_json(raw)

    def check_size(self, items: list[dict[str, Any]], param: str) -> None:
        """Refuse (400) a conversation that could not be stored, before anything is queued."""
        size = len(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode())
        if size > self.max_bytes:
            raise InvalidRequest(
                f"{param}: the conversation is {size} bytes; stored responses hold at most {self.max_bytes} "
                "(responsesMaxBytes). Start a new conversation or send store: false.",
                param=param,
            )

    def save(self, scope: str, record: StoredResponse) -> None:
        with self.connection.pipeline() as pipe:  # MULTI: the record and its items' index together
            self._write(pipe, scope, record)
            pipe.execute()
        logger.info("stored request_id=%s", record.response["id"])

    def _write(self, pipe: redis.client.Pipeline, scope: str, record: StoredResponse) -> None:
        response_id = record.response["id"]
        pipe.set(stored_response_key(scope, response_id), record.to_json().encode(), px=self.ttl_ms)
        for item in (*record.input_items, *record.response.get("output", ())):
            if item.get("id"):
                pipe.set(stored_item_key(scope, item["id"]), response_id, px=self.ttl_ms)

    def item_response(self, scope: str, item_id: str) -> str | None:
        """The id of the stored response that holds the item `item_id` (the latest to, where several
        did), or None."""
        found = self.connection.get(stored_item_key(scope, item_id))
        return None if found is None else found.decode()

    def update(
        self, scope: str, response_id: str, change: Callable[[StoredResponse | None], StoredResponse | None]
    ) -> StoredResponse | None:
        """Store what `change` makes of the stored record (None where there is none; it returns None
        to store nothing), atomically: where another process writes the record in between, Redis
        refuses the write (WATCH) and `change` runs again on what is stored then. Returns what was
        stored, or None."""
        key = stored_response_key(scope, response_id)

        def apply(pipe: redis.client.Pipeline) -> StoredResponse | None:
            raw = pipe.get(key)
            record = change(None if raw is None else StoredResponse.from_json(raw))
            pipe.multi()
            if record is not None:
                self._write(pipe, scope, record)
            return record

        return self.connection.transaction(apply, key, value_from_callable=True)

    def delete(self, scope: str, response_id: str) -> StoredResponse:
        """Delete the record; it is returned as it was."""
        key = stored_response_key(scope, response_id)
        with self.connection.pipeline() as pipe:  # MULTI: read and deleted in one step
            raw, _ = pipe.get(key).delete(key).execute()
        if raw is None:
            raise ResponseNotFound(f"Response with id '{response_id}' not found.")
        return StoredResponse.from_json(raw)
