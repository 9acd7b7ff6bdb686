"""Stored responses (app/conversations.py) on a real, empty Redis: kept under the API key's scope with
a TTL, gone after it, refused past the size bound, a follow-up's conversation read from one key, and a
background response's writes (app/responses_api.py) read the record in the same transaction as a
cancel or a delete from another process."""

from __future__ import annotations

import pytest
import redis

from app.chat_deltas import Finished
from app.conversations import ResponseNotFound, ResponseStore, StoredResponse, key_scope
from app.response_runs import ResponseRun, ResponsesApi
from app.responses_format import ResponseEvents
from schemas.errors import InvalidRequest
from schemas.keys import stored_response_key
from scripts import localstack

RESPONSE_ID = "resp_" + "a" * 32
QUESTION = {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
ANSWER = {
    "type": "message",
    "id": "msg_2",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
}


def record(context: list | None = None) -> StoredResponse:
    return StoredResponse({"id": RESPONSE_ID, "object": "response", "output": [ANSWER]}, [QUESTION], context or [])


def test_a_stored_response_is_read_back_with_its_conversation(redis_conn: redis.Redis) -> None:
    store = ResponseStore(redis_conn, ttl=60, max_bytes=10_000)
    store.save("scope-a", record(context=[{"type": "message", "id": "msg_0"}]))
    loaded = store.load("scope-a", RESPONSE_ID)
    assert loaded.response["id"] == RESPONSE_ID and loaded.input_items == [QUESTION]
    assert [item["id"] for item in loaded.conversation()] == ["msg_0", "msg_1", "msg_2"]
    assert 0 < redis_conn.pttl(stored_response_key("scope-a", RESPONSE_ID)) <= 60_000


def test_a_stored_response_is_gone_after_its_ttl(redis_conn: redis.Redis) -> None:
    store = ResponseStore(redis_conn, ttl=0.2, max_bytes=10_000)
    store.save("scope-b", record())
    assert store.load("scope-b", RESPONSE_ID).response["id"] == RESPONSE_ID
    key = stored_response_key("scope-b", RESPONSE_ID)
    localstack.wait_for(lambda: not redis_conn.exists(key), 5, "the stored response to expire")
    with pytest.raises(ResponseNotFound):
        store.load("scope-b", RESPONSE_ID)


def test_another_scope_finds_nothing_and_delete_is_scoped(redis_conn: redis.Redis) -> None:
    store = ResponseStore(redis_conn, ttl=60, max_bytes=10_000)
    store.save(key_scope("key-one"), record())
    with pytest.raises(ResponseNotFound):
        store.load(key_scope("key-two"), RESPONSE_ID)
    with pytest.raises(ResponseNotFound):
        store.delete(key_scope("key-two"), RESPONSE_ID)
    store.delete(key_scope("key-one"), RESPONSE_ID)
    with pytest.raises(ResponseNotFound):
        store.load(key_scope("key-one"), RESPONSE_ID)


def test_a_conversation_past_the_size_bound_is_refused_naming_the_field() -> None:
    store = ResponseStore(None, ttl=60, max_bytes=100)  # type: ignore[arg-type]  # no Redis is touched
    store.check_size([QUESTION], "input")
    with pytest.raises(InvalidRequest) as caught:
        store.check_size([QUESTION] * 3, "previous_response_id")
    assert caught.value.param == "previous_response_id" and "responsesMaxBytes" in caught.value.message


def test_the_scope_is_a_digest_not_the_key() -> None:
    assert key_scope("secret-key") != key_scope("other-key") and "secret" not in key_scope("secret-key")
    assert len(key_scope("")) == 32


def test_a_follow_up_leaves_out_a_call_its_output_ended_inside() -> None:
    whole = {"type": "function_call", "id": "fc_1", "call_id": "a", "name": "f", "arguments": "{}"}
    cut = {"type": "function_call", "id": "fc_2", "call_id": "b", "name": "f", "arguments": '{"q": "x'}
    stored = StoredResponse({"id": RESPONSE_ID, "output": [whole, cut]}, [QUESTION])
    assert [item["id"] for item in stored.conversation()] == ["msg_1", "fc_1"]


def test_a_follow_up_leaves_out_a_message_its_output_ended_before_any_text() -> None:
    """A run that failed or was cancelled before its first token stores an empty message; continued
    from, it made the follow-up's chat end in an empty assistant turn, a 400 that blamed `input`."""
    empty = {**ANSWER, "id": "msg_3", "status": "incomplete", "content": [{"type": "output_text", "text": ""}]}
    unopened = {**ANSWER, "id": "msg_4", "status": "incomplete", "content": []}
    refused = {**ANSWER, "id": "msg_5", "content": [{"type": "refusal", "refusal": "No."}]}
    stored = StoredResponse({"id": RESPONSE_ID, "output": [ANSWER, empty, unopened, refused]}, [QUESTION])
    assert [item["id"] for item in stored.conversation()] == ["msg_1", "msg_2", "msg_5"]


def test_update_runs_again_on_a_record_written_in_between(redis_conn: redis.Redis, redis_url: str) -> None:
    store = ResponseStore(redis_conn, ttl=60, max_bytes=10_000)
    store.save("scope-c", record())
    other = ResponseStore(redis.Redis.from_url(redis_url), ttl=60, max_bytes=10_000)  # another API process
    seen: list[str] = []

    def change(stored: StoredResponse | None) -> StoredResponse | None:
        assert stored is not None
        seen.append(stored.response.get("status", "none"))
        if len(seen) == 1:  # another process writes the record after this read: this write is refused
            other.save("scope-c", StoredResponse({**stored.response, "status": "cancelled"}, stored.input_items))
        stored.response["note"] = "kept"
        return stored

    written = store.update("scope-c", RESPONSE_ID, change)
    assert seen == ["none", "cancelled"]
    assert written is not None and store.load("scope-c", RESPONSE_ID).response["status"] == "cancelled"
    assert store.load("scope-c", RESPONSE_ID).response["note"] == "kept"
    assert store.update("scope-c", "resp_" + "b" * 32, lambda stored: stored) is None  # none stored: none made


def background_run(store: ResponseStore, status: str) -> tuple[ResponsesApi, ResponseRun]:
    """A background response's run as its API thread holds it, its output so far one message."""
    response = {"id": RESPONSE_ID, "object": "response", "status": status, "background": True, "output": []}
    builder = ResponseEvents(response)
    builder.delta({"content": "Hel"})
    run = ResponseRun(None, "scope-d", None, builder, StoredResponse(response, [QUESTION]))  # type: ignore[arg-type]
    return ResponsesApi(None, store), run  # type: ignore[arg-type]  # the store is all these writes use


def test_a_cancelled_background_response_stays_cancelled(redis_conn: redis.Redis) -> None:
    store = ResponseStore(redis_conn, ttl=60, max_bytes=10_000)
    api, run = background_run(store, "queued")
    store.save("scope-d", StoredResponse({**run.record.response, "status": "cancelled", "output": []}, [QUESTION]))
    run.record.response["status"] = "in_progress"
    api._store_started(run)  # the cancel came first: not in progress again
    assert store.load("scope-d", RESPONSE_ID).response["status"] == "cancelled"
    run.builder.finish(Finished("length", 3, 4, 0))  # and it ended before the worker dropped it
    api._store_ended(run)
    stored = store.load("scope-d", RESPONSE_ID).response
    assert stored["status"] == "cancelled" and stored["output"][0]["content"][0]["text"] == "Hel"


def test_a_deleted_background_response_is_not_stored_again(redis_conn: redis.Redis) -> None:
    store = ResponseStore(redis_conn, ttl=60, max_bytes=10_000)
    api, run = background_run(store, "queued")
    store.save("scope-d", run.record)
    store.delete("scope-d", RESPONSE_ID)
    run.record.response["status"] = "in_progress"
    api._store_started(run)
    run.builder.finish(Finished("stop", 3, 4, 0))
    api._store_ended(run)
    assert not redis_conn.exists(stored_response_key("scope-d", RESPONSE_ID))


def test_a_response_whose_process_is_gone_is_stored_as_it_ends_now(redis_conn: redis.Redis) -> None:
    """What the next reader stores of a background response whose API process died: failed, or
    cancelled where a cancel came first, its open item closed with what it holds."""
    store = ResponseStore(redis_conn, ttl=60, max_bytes=10_000)
    api = ResponsesApi(None, store)  # type: ignore[arg-type]  # the store is all a settle uses
    call = {"type": "function_call", "id": "fc_1", "status": "in_progress", "call_id": "a", "name": "f"}
    for status, arguments in (("in_progress", '{"q": "x'), ("cancelled", "{}")):
        response = {
            "id": RESPONSE_ID,
            "status": status,
            "background": True,
            "output": [{**call, "arguments": arguments}],
        }
        store.save("scope-e", StoredResponse(response, [QUESTION], owner="tokenline:reply:gone"))
        assert api._settle("scope-e", RESPONSE_ID, "tokenline:reply:other") is None  # not that process's run
        api._settle("scope-e", RESPONSE_ID, "tokenline:reply:gone")
        stored = store.load("scope-e", RESPONSE_ID).response
        assert stored["status"] == ("failed" if status == "in_progress" else "cancelled")
        assert stored["output"] == [{**call, "arguments": arguments, "status": "incomplete"}]
    assert stored["status"] == "cancelled" and "error" not in stored
