"""Anthropic's Messages API on the chat path: a Messages request becomes the chat request the service
runs, and the chat deltas of its generation become content blocks (text, thinking, tool_use) and the
streamed events (message_start, content_block_start / _delta / _stop, message_delta, message_stop).

`MessageEvents` builds both: a stream sends its events as they come; a plain request returns the
message the same events completed. Errors use Anthropic's envelope (`anthropic_envelope`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from app.chat_deltas import Finished
from schemas.errors import ContextLengthExceeded, InvalidRequest, TokenlineError
from schemas.messages import MessagesRequest

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_CHAT_PARAMS = (
    (re.compile(r"^max_completion_tokens"), "max_tokens"),
    (re.compile(r"^stop"), "stop_sequences"),
    (re.compile(r"^(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^tool_choice.*"), "tool_choice"),
    (re.compile(r"^chat_template_kwargs.*"), "thinking"),
    (re.compile(r"^thinking_token_budget"), "thinking.budget_tokens"),
    (re.compile(r"^response_format.*"), "output_config.format"),
    (re.compile(r"^reasoning_effort"), "output_config.effort"),
)


def chat_body(request: MessagesRequest) -> dict[str, Any]:
    """The chat request for a Messages request."""
    messages = [{"role": "system", "content": request.system}] if request.system else []
    for message in merged_turns(shown(request.messages)):
        messages += chat_messages(message)
    body: dict[str, Any] = {"model": request.model, "messages": messages, **request.extra}
    if request.messages[-1]["role"] == "assistant":  # a prefill, which the answer continues
        body["continue_final_message"] = True
    if request.tools:
        body["tools"] = [_chat_tool(tool) for tool in request.tools]
    choice = request.tool_choice
    if request.tools or choice["type"] != "auto":
        names = {"auto": "auto", "any": "required", "none": "none"}
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if choice["type"] == "tool"
            else names[choice["type"]]
        )
    if request.tools:
        body["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use")
    if request.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking}
    if request.output_schema is not None and choice["type"] not in ("any", "tool"):
        # A forced call writes no text for the format to shape (as the Responses API drops it then).
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": request.output_schema, "strict": True},
        }
    optional = {
        "max_completion_tokens": request.max_tokens,
        "stop": list(request.stop_sequences) or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "user": request.user,
        "reasoning_effort": request.effort,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


def shown(messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The messages the model reads: a system message cleared at the next user message is left out
    once one follows it."""
    last_user = max((i for i, message in enumerate(messages) if message["role"] == "user"), default=-1)
    return [
        message
        for i, message in enumerate(messages)
        if not (message.get("clear_at") == "next_user_message" and i < last_user)
    ]


def merged_turns(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive turns of one role as one turn, their blocks in order, as Anthropic combines them (a
    template that wants the roles to alternate takes them so)."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        if turns and turns[-1]["role"] == message["role"]:
            turns[-1] = {**turns[-1], "content": (*turns[-1]["content"], *message["content"])}
        else:
            turns.append(message)
    return turns


def chat_messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results are tool messages (before its
    text, as Anthropic orders them); an assistant turn's tool_use blocks are its tool calls and its
    thinking is its reasoning."""
    blocks = message["content"]
    text = "\n".join(block["text"] for block in blocks if block["type"] == "text")
    if message["role"] == "system":
        return [{"role": "system", "content": text}]
    if message["role"] == "user":
        results = [
            {"role": "tool", "tool_call_id": call_id(block["tool_use_id"]), "content": _result_text(block)}
            for block in blocks
            if block["type"] == "tool_result"
        ]
        return [*results, {"role": "user", "content": text}] if text else results
    calls = [
        {
            "id": call_id(block["id"]),
            "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
        }
        for block in blocks
        if block["type"] == "tool_use"
    ]
    thinking = "".join(block["thinking"] for block in blocks if block["type"] == "thinking")
    # No text beside calls or thinking (a reply cut by max_tokens while it reasoned) is no content.
    assistant: dict[str, Any] = {"role": "assistant", "content": text or (None if calls or thinking else text)}
    if calls:
        assistant["tool_calls"] = calls
    if thinking:
        assistant["reasoning_content"] = thinking
    return [assistant]


def _result_text(block: dict[str, Any]) -> str:
    """A tool result's text; chat has no error flag, so an error result says so in its text."""
    return f"Error: {block['content']}" if block["is_error"] else block["content"]


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    description = tool_description(tool.get("description"), tool.get("input_examples") or ())
    if description is not None:
        function["description"] = description
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def tool_description(description: str | None, examples: Iterable[dict[str, Any]]) -> str | None:
    """A tool's description as the chat template shows it: its input examples (Anthropic's
    `input_examples`) follow it, one JSON object a line."""
    lines = [json.dumps(example, ensure_ascii=False) for example in examples]
    if not lines:
        return description
    return "\n\n".join(filter(None, (description, "Examples of input:\n" + "\n".join(lines))))


def context_error(exc: ContextLengthExceeded, counts: tuple[int, int | None, int]) -> ContextLengthExceeded:
    """A request too long for the context in Anthropic's words, which its clients read: Claude Code
    retries with the max_tokens that fits, or compacts a conversation whose prompt is too long."""
    prompt, max_tokens, limit = counts
    if max_tokens is None:
        message = f"prompt is too long: {prompt} tokens > {limit} maximum"
    else:
        message = (
            f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {limit}, "
            "decrease input length or `max_tokens` and try again"
        )
    return ContextLengthExceeded(message, param=exc.param, counts=counts)


def messages_error(exc: InvalidRequest) -> InvalidRequest:
    """A chat validation error, named as the Messages request's field, in its message (Anthropic's
    errors have no `param`): a message that does not start with the field (a chat template's own
    words) gets it in front."""
    param = exc.param or ""
    renamed = messages_param(param)
    message = exc.message.replace(param, renamed, 1) if renamed != param else exc.message
    return type(exc)(named(message, renamed), param=renamed or None, code=exc.code)


def messages_param(param: str) -> str:
    """A chat request's field, named as the Messages request's."""
    if param.startswith("messages"):
        return "messages"
    for pattern, name in _CHAT_PARAMS:
        if pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def named(message: str, param: str | None) -> str:
    """An error's message with the field it is about in front, where it does not name it already:
    Anthropic's errors carry no `param`."""
    if not param or re.search(rf"(?<![\w.\[]){re.escape(param)}(?!\w)", message):
        return message
    return f"{param}: {message}"


def anthropic_envelope(
    status: int, message: str, request_id: str | None = None, param: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "error",
        # Anthropic: invalid_request_error also stands for the 4xx it does not list, api_error for the 5xx.
        "error": {
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error"),
            "message": named(message, param),
        },
    }
    if param == "thread":
        # What Anthropic answers a request it cannot thread: the SDKs' tool runners (anthropic 2.14,
        # @anthropic-ai/sdk 1.14) read it and send the turn, and those after it, without a thread.
        body["error"]["details"] = {"error_code": "thread_unsupported_request", "unsupported": []}
    if request_id:
        body["request_id"] = request_id
    return body


def tool_use_id(chat_id: str) -> str:
    """Anthropic's shape of a call id: `toolu_` and the chat id, whole, so that `call_id` gives back
    the id the model wrote where its template renders ids (Mistral's 9 characters, Kimi's)."""
    return "toolu_" + chat_id


def call_id(tool_use: str) -> str:
    """The chat id of a tool_use id a client sends back (one `tool_use_id` made; another, as it is)."""
    return tool_use.removeprefix("toolu_")


class MessageEvents:
    """The streamed events of one message, from chat deltas, and the message they build.

    A stop sequence that ended the text (the worker names it: vLLM's stop_reason) ends the message
    with `stop_reason: "stop_sequence"`; the sequence itself is not in the text, as Anthropic answers.
    A text block opens with its first character: a stop sequence that takes the whole text leaves none
    (Anthropic refuses an empty one sent back). With `omit_thinking` (thinking.display "omitted") a
    thinking block opens and closes without its text, as Anthropic redacts it."""

    def __init__(
        self,
        message_id: str,
        model: str,
        prompt_tokens: int,
        stops: tuple[str, ...] = (),
        omit_thinking: bool = False,
        buffered: frozenset[str] = frozenset(),
    ) -> None:
        self.message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(prompt_tokens, 0),
        }
        self.block: dict[str, Any] | None = None  # the content block being written
        self.pieces: list[str] = []
        self.stops = stops
        self.omit_thinking = omit_thinking
        self.buffered = buffered  # tools whose input goes in one delta (eager_input_streaming false)

    def start(self) -> list[dict[str, Any]]:
        return [
            {"type": "message_start", "message": {**self.message, "content": [], "usage": dict(self.message["usage"])}}
        ]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if "reasoning_content" in delta:
            return self._text("thinking", delta["reasoning_content"])
        if "content" in delta:
            return self._text("text", delta["content"])
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events += self._close()
                block = {
                    "type": "tool_use",
                    "id": tool_use_id(call["id"]),
                    "name": call["function"]["name"],
                    "input": {},
                }
                events += self._open(block)
            arguments = call["function"]["arguments"]
            if arguments:
                self.pieces.append(arguments)
                if self.block is not None and self.block.get("name") not in self.buffered:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def finish(self, finished: Finished) -> list[dict[str, Any]]:
        if finished.reason == "stop" and finished.stop_reason in self.stops:
            self.message["stop_sequence"] = finished.stop_reason
        events = self._close()
        reason = "stop_sequence" if self.message["stop_sequence"] else STOP_REASONS.get(finished.reason or "stop")
        self.message["stop_reason"] = reason or "end_turn"
        self.message["usage"] = usage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        delta = {"stop_reason": self.message["stop_reason"], "stop_sequence": self.message["stop_sequence"]}
        return [
            *events,
            {"type": "message_delta", "delta": delta, "usage": ending_usage(self.message["usage"])},
            {"type": "message_stop"},
        ]

    def fail(self, error: TokenlineError) -> list[dict[str, Any]]:
        return [anthropic_envelope(error.status, error.message, param=error.param)]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self.block is not None and self.block["type"] != kind:
            events += self._close()
        if self.block is None:
            events += self._open(
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
        if kind == "thinking" and self.omit_thinking:
            return events
        self.pieces.append(text)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return [*events, self._delta(delta)]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.block, self.pieces = block, []
        self.message["content"].append(block)
        return [{"type": "content_block_start", "index": self._index(), "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index(), "delta": delta}

    def _index(self) -> int:
        return len(self.message["content"]) - 1

    def _close(self) -> list[dict[str, Any]]:
        block = self.block
        if block is None:
            return []
        text = "".join(self.pieces)
        events = []
        if block["type"] == "tool_use":
            block["input"] = _arguments(text)
            if block["name"] in self.buffered and text:
                events.append(self._delta({"type": "input_json_delta", "partial_json": text}))
        else:
            block[block["type"]] = text
        self.block, self.pieces = None, []
        return [*events, {"type": "content_block_stop", "index": self._index()}]


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; arguments cut short (max_tokens) are {}."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens`
    those the worker's prefix cache held (their sum is the prompt)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def ending_usage(final: dict[str, Any]) -> dict[str, Any]:
    """message_delta's usage: the output, and the input as the prefill found it (message_start, sent
    before it, counts the whole prompt as input)."""
    return {k: final[k] for k in ("input_tokens", "output_tokens", "cache_read_input_tokens")}


def sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


PING = sse_event({"type": "ping"})
