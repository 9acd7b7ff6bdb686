"""vLLM-style /generate responses, in MindIE's flavour (default) or vLLM's.

- "mindie": non-stream `{"text": "<generated>"}`; stream: one `{"text": "<this step's delta>"}` per step.
- "vllm":   non-stream `{"text": ["<prompt + generated>"]}`; stream: `{"text": ["<prompt + text so far>"]}`.
Streamed objects are each followed by a '\\0' byte. An error mid-stream is sent as `{"error": {...}}`.
A stream that ends without text (a stop string met at its first token) still sends one object, as vLLM
sends its final output: `{"text": ""}`, or `{"text": ["<prompt>"]}`; without it a client could not tell
a finished stream from a dropped connection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from app.generation import Generation
from app.openai_format import raise_for_event
from schemas.errors import ClientGone, GenerationFailed, TokenlineError
from schemas.job import Event

logger = logging.getLogger(__name__)

SEPARATOR = b"\0"


def generate_response(generation: Generation, events: Iterable[Event | None], style: str) -> dict[str, Any]:
    parts = []
    for event in events:
        if event is None:
            continue
        raise_for_event(event)
        if event.kind == "token":
            parts.append(event.text)
    text = "".join(parts)
    return {"text": [generation.prompt + text]} if style == "vllm" else {"text": text}


def generate_stream(generation: Generation, events: Iterable[Event | None], style: str) -> Iterator[bytes]:
    cumulative = generation.prompt
    sent = False
    try:
        for event in events:
            if event is None:
                continue
            raise_for_event(event)
            if event.kind == "done" and not sent:
                yield _frame({"text": [cumulative]} if style == "vllm" else {"text": ""})
            if event.kind != "token" or not event.text:
                continue
            sent = True
            if style == "vllm":
                cumulative += event.text
                yield _frame({"text": [cumulative]})
            else:
                yield _frame({"text": event.text})
    except ClientGone:
        logger.info("client left request_id=%s", generation.request_id)  # no one to write the error to
    except TokenlineError as exc:
        logger.warning("stream ended with an error request_id=%s: %s", generation.request_id, exc.message)
        yield _frame(exc.envelope())
    except Exception:
        logger.exception("stream failed request_id=%s", generation.request_id)
        yield _frame(GenerationFailed("Internal error during generation.").envelope())


def _frame(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + SEPARATOR
