"""OpenAI's Responses API on the chat path: a Responses request (and the stored conversation it
continues) becomes the chat request the service runs, and the chat deltas of its generation become
the response's output items and its streamed semantic events, each with its `sequence_number`.

`ResponseEvents` builds both: a stream sends its events as they come; a plain request returns the
response object the same events completed, so the two always agree.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import time
from collections.abc import Mapping
from typing import Any

from app.chat_deltas import Finished
from app.parsers import arguments_complete
from schemas.errors import InvalidRequest, TokenlineError
from schemas.response_items import new_item_id, seal_reasoning
from schemas.responses import ResponsesRequest, function_tools, namespaces
from schemas.sampling import SamplingParams

# The sampling values a response echoes: the request's, else the model's defaults, else the worker's.
ECHOED_SAMPLING = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.name in ("temperature", "top_p")}

# Chat's parameter names, as a Responses client knows them (the chat schema validates the translation).
_CHAT_PARAMS = (
    (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^messages.*"), "input"),
    (re.compile(r"^reasoning_effort"), "reasoning.effort"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice.*"), "tool_choice"),
)


def chat_body(request: ResponsesRequest, context: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request for a Responses request that continues `context` (a stored conversation)."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += chat_messages([*context, *request.items])
    body: dict[str, Any] = {"model": request.model, "messages": messages, **request.extra}
    if request.tools:
        body["tools"] = [_chat_tool(tool) for tool in function_tools(request.tools)]
        body["parallel_tool_calls"] = request.parallel_tool_calls
    choice = request.tool_choice
    if isinstance(choice, dict) and choice["type"] == "allowed_tools":
        named = [{"type": "function", "function": {"name": tool["name"]}} for tool in choice["tools"]]
        body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {"mode": choice["mode"], "tools": named}}
    elif isinstance(choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif request.tools or choice != "auto":
        body["tool_choice"] = choice
    forced = choice == "required" or (isinstance(choice, dict) and choice.get("mode", "required") == "required")
    if not forced:
        # A forced call writes no text, so text.format has nothing to shape (agents send both).
        body["response_format"] = _response_format(request.text_format)
    if request.logprobs:
        body |= {"logprobs": True, "top_logprobs": request.top_logprobs}
    optional = {
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "reasoning_effort": request.reasoning_effort,
        "user": request.user,
        "safety_identifier": request.safety_identifier,
        "prompt_cache_key": request.prompt_cache_key,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


def responses_param(param: str) -> str:
    """A chat request's field, named as the Responses request's."""
    for pattern, name in _CHAT_PARAMS:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def responses_error(exc: InvalidRequest) -> InvalidRequest:
    """A chat validation error, named as the Responses request's field."""
    param = exc.param or ""
    renamed = responses_param(param)
    if renamed == param:
        return exc
    # The field's chat name where the message says it (first, or as a word in a sentence).
    said = re.compile(rf"(?<![\w.\[]){re.escape(param)}(?![\w\[])")
    message = said.sub(renamed.replace("\\", "\\\\"), exc.message)
    return type(exc)(message, param=renamed, code=exc.code)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses items as chat messages: function calls join the assistant message before them,
    a function call's output is a tool message, reasoning goes with the assistant turn after it."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning += [part["text"] for part in item.get("content") or item.get("summary") or ()]
            continue
        if kind == "message":
            text = "\n".join(part.get("text", part.get("refusal", "")) for part in item["content"])
            message: dict[str, Any] = {"role": item["role"], "content": text}
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:  # function_call_output
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
        if reasoning and message["role"] == "assistant":
            message["reasoning_content"] = "".join(reasoning)
            reasoning = []
        messages.append(message)
    return messages


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as the response echoes it: a function with OpenAI's defaults, a namespace with its functions."""
    if tool["type"] == "namespace":
        return {"description": None, **tool, "tools": [_echoed_tool(inner) for inner in tool["tools"]]}
    return {"description": None, "parameters": None, "strict": True, **tool}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as chat's. Its `strict` is true unless the client says false, as in
    OpenAI's Responses API (chat's default is false)."""
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    function["strict"] = tool.get("strict") is not False
    return {"type": "function", "function": function}


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    spec = {key: text_format[key] for key in ("name", "schema", "description", "strict") if key in text_format}
    return {"type": "json_schema", "json_schema": spec}


def response_object(
    request: ResponsesRequest, response_id: str, created: int, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The response as it starts (in_progress, no output): the request's settings echoed back, and
    the temperature and top_p it samples with where the request sets none (`defaults`: the model's
    generation_config.json values), as OpenAI echoes them."""
    choice = request.tool_choice
    sampling = {
        name: value if (value := getattr(request, name)) is not None else (defaults or {}).get(name, default)
        for name, default in ECHOED_SAMPLING.items()
    }
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "background": request.background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning_effort, "summary": request.reasoning_summary},
        "service_tier": request.service_tier,
        "store": request.store,
        "temperature": sampling["temperature"],
        "text": {"format": request.text_format, "verbosity": "medium"},
        "tool_choice": choice,
        "tools": [_echoed_tool(tool) for tool in request.tools],
        "top_logprobs": request.top_logprobs,
        "top_p": sampling["top_p"],
        "truncation": request.truncation,
        "usage": None,
        "user": request.user,
        "metadata": request.metadata,
        "safety_identifier": request.safety_identifier,
        "prompt_cache_key": request.prompt_cache_key,
    }


class ResponseEvents:
    """The semantic events of one response, from chat deltas, and the response they build."""

    def __init__(self, response: dict[str, Any], encrypted_reasoning: bool = False) -> None:
        self.response = response
        # include's reasoning.encrypted_content: a reasoning item ends with its text sealed in it (a
        # stored response settled by another process, `resumed`, ends failed or cancelled, without it).
        self.encrypted_reasoning = encrypted_reasoning
        self.sequence = 0
        self.item: dict[str, Any] | None = None  # the output item being written
        self.pieces: list[str] = []  # its text or arguments so far
        self.logprobs: list[dict[str, Any]] = []  # a message's tokens' logprobs so far, where asked for
        # reasoning.summary asked for: the reasoning is the item's summary_text, else its reasoning_text.
        self.summary = bool((response.get("reasoning") or {}).get("summary"))
        self.namespaces = namespaces(response.get("tools") or ())  # a call of one of their functions names it

    @classmethod
    def resumed(cls, response: dict[str, Any]) -> ResponseEvents:
        """The builder of a stored response whose run is gone, to end it: its open item (the last, if
        still in progress) is taken up with the text it holds."""
        builder = cls(response)
        output = response.get("output") or []
        if output and output[-1].get("status") == "in_progress":
            item = builder.item = output[-1]
            if item["type"] == "function_call":
                builder.pieces = [item.get("arguments", "")]
            else:
                parts = item.get("summary") if builder.summary and item["type"] == "reasoning" else item.get("content")
                part = (parts or [{}])[0]
                builder.pieces, builder.logprobs = [part.get("text", "")], list(part.get("logprobs") or ())
        return builder

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=copy.deepcopy(self.response)),
            self._event("response.in_progress", response=copy.deepcopy(self.response)),
        ]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"], delta.get("logprobs", []))
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events += self._close("completed")
                events += self._open_call(call["id"], call["function"]["name"])
            arguments = call["function"]["arguments"]
            if arguments:
                self.pieces.append(arguments)
                events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def finish(self, finished: Finished) -> list[dict[str, Any]]:
        incomplete = finished.reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        self.response["status"] = "incomplete" if incomplete else "completed"
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.response["completed_at"] = int(time.time())  # OpenAI's, on a completed response only
        self.response["usage"] = usage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(kind, response=copy.deepcopy(self.response))]

    def fail(self, error: TokenlineError) -> list[dict[str, Any]]:
        events = self._close("incomplete")
        self.response["status"] = "failed"
        self.response["error"] = {"code": response_error_code(error), "message": error.message}
        return [*events, self._event("response.failed", response=copy.deepcopy(self.response))]

    def cancel(self) -> list[dict[str, Any]]:
        """A background response cancelled (POST …/cancel): its output as far as it got."""
        events = self._close("incomplete")
        self.response["status"] = "cancelled"
        return events

    def _event(self, kind: str, **body: Any) -> dict[str, Any]:
        event = {"type": kind, **body, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def _where(self, part: bool = False) -> dict[str, Any]:
        """The open item's place; `part`: its (one) part's too, a summary's or the content's."""
        assert self.item is not None
        where = {"item_id": self.item["id"], "output_index": len(self.response["output"]) - 1}
        if not part:
            return where
        return {**where, "summary_index" if self._summarized() else "content_index": 0}

    def _summarized(self) -> bool:
        return self.summary and self.item is not None and self.item["type"] == "reasoning"

    def _text(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events = []
        if self.item is None or self.item["type"] != kind:
            events += self._close("completed")
            events += self._open_text(kind)
        self.pieces.append(text)
        self.logprobs += logprobs or []
        delta = {
            "message": "response.output_text.delta",
            "reasoning": "response.reasoning_summary_text.delta" if self.summary else "response.reasoning_text.delta",
        }[kind]
        extra = {"logprobs": logprobs or []} if kind == "message" else {}
        return [*events, self._event(delta, **self._where(part=True), delta=text, **extra)]

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {
                "id": new_item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "summary_text" if self.summary else "reasoning_text", "text": ""}
        added = self._open(item)
        kind = "response.reasoning_summary_part.added" if self._summarized() else "response.content_part.added"
        return [*added, self._event(kind, **self._where(part=True), part=dict(part))]

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        item = {
            "id": new_item_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            **({"namespace": self.namespaces[name]} if name in self.namespaces else {}),
            "arguments": "",
        }
        return self._open(item)

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.item, self.pieces, self.logprobs = item, [], []
        self.response["output"].append(item)
        return [
            self._event("response.output_item.added", output_index=len(self.response["output"]) - 1, item=dict(item))
        ]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self.item
        if item is None:
            return []
        text = "".join(self.pieces)
        where = self._where()
        if item["type"] == "function_call":
            item["arguments"] = text
            if not arguments_complete(text):  # the output ended inside the call (a stop sequence)
                status = "incomplete"
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        elif self._summarized():
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            ended = {"status": "incomplete"} if status == "incomplete" else {}
            events = [
                self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=dict(part), **ended),
            ]
        else:
            message = item["type"] == "message"
            part = (
                {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs}
                if message
                else {"type": "reasoning_text", "text": text}
            )
            item["content"] = [part]
            done = "response.output_text.done" if message else "response.reasoning_text.done"
            extra = {"logprobs": self.logprobs} if message else {}
            events = [
                self._event(done, **where, content_index=0, text=text, **extra),
                self._event("response.content_part.done", **where, content_index=0, part=dict(part)),
            ]
        if item["type"] == "reasoning" and self.encrypted_reasoning:
            item["encrypted_content"] = seal_reasoning(text)
        item["status"] = status
        self.item, self.pieces = None, []
        return [
            *events,
            self._event("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)),
        ]


def response_error_code(error: TokenlineError) -> str:
    """A failed response's `error.code`, one of the Responses API's codes (the SDK's type lists them):
    a request's own error is `invalid_prompt`, too many requests `rate_limit_exceeded`, anything else
    `server_error`; the message says which error it was."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if 400 <= error.status < 500 else "server_error"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A response's usage (`cache_write_tokens` counts OpenAI's explicit cache writes: tokenline's prefix
    cache is automatic, and has none)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
