"""Stored responses (app/conversations.py) on a real, empty Redis: kept under the API key's scope with
a TTL, gone after it, refused past the size bound, and a follow-up's conversation read from one key."""

from __future__ import annotations

import pytest
import redis

from app.conversations import ResponseNotFound, ResponseStore, StoredResponse, key_scope
from schemas.errors import InvalidRequest
from schemas.keys import stored_response_key
from scripts import localstack

RESPONSE_ID = "resp-" + "a" * 32
QUESTION = {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
ANSWER = {"type": "message", "id": "msg_2", "role": "assistant", "status": "completed", "content": []}


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
