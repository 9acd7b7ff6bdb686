"""What a model writes, split the way OpenAI clients read it: reasoning, content and tool calls.

One `ChoiceParser` per choice takes the text as it streams (`feed`) and answers the deltas that are
safe to send, in OpenAI's delta shape: `{"reasoning_content": …}`, `{"content": …}`, or
`{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}` for a call's start and
`{"tool_calls": [{"index", "function": {"arguments"}}]}` for each later piece of its arguments,
which arrive as the model writes them (app/tools/). `close` answers the rest. The non-streamed
message is these same deltas joined, so the two always agree.

- reasoning "think": `<think>…</think>` before the answer (Qwen3, QwQ, DeepSeek-R1, Kimi-K2-Thinking);
  when the chat template already opened the tag in the prompt, the output starts inside it.
- tools: the model's own format (app/tools/formats.py), or the forced choices: "named" (the output
  is the named function's arguments) and "required" (a JSON array of `{"name", "parameters"}`), after
  the reasoning of a model that reasons (the worker's grammar starts there).
- content that is only whitespace is held until words follow it: a reply that is only reasoning or
  only tool calls has no content (`null`), not "\\n\\n".
- without parallel calls (`parallel_tool_calls: false`), a call after the first is dropped whole, as
  vLLM drops it: the model's format may let it write several.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from app import tools
from app.tools import Arguments, CallReader, CallStart, Text
from app.tools.pieces import held

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MISTRAL_ID_ALPHABET = string.ascii_letters + string.digits


def detect_tool_parser(template: str | None) -> str:
    """The tool-call format a chat template teaches its model, or "none"."""
    return tools.detect(template)


def detect_reasoning_parser(template: str | None) -> str:
    return "think" if THINK_CLOSE in (template or "") else "none"


def arguments_complete(text: str) -> bool:
    """Whether a call's arguments, as the formats write them (JSON), are whole."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def new_call_id(style: str = "openai") -> str:
    """A tool call's id. Mistral's templates refuse any but 9 letters and digits (vLLM makes the same);
    elsewhere OpenAI's shape, `call_` and 24 hex digits."""
    if style == "mistral":
        return "".join(secrets.choice(MISTRAL_ID_ALPHABET) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChoiceParser:
    reasoning: bool = False  # the model thinks in <think>…</think>
    thinking: bool = False  # the prompt already opened <think>
    tools: str = "none"  # none, a model's format (app/tools/formats.py), named, required
    tool_name: str | None = None
    parallel: bool = True  # False: only the first call is answered
    call_ids: str = "openai"  # "mistral": ids of 9 letters and digits
    parameters: dict[str, Any] = field(default_factory=dict)  # function name → parameters schema
    phase: str = field(init=False, default="start")  # start, reasoning, answer
    pending: str = field(init=False, default="")
    blank: str = field(init=False, default="")  # whitespace content, held until words follow
    spoken: bool = field(init=False, default=False)  # content with words in it has gone out
    reasoned: bool = field(init=False, default=False)
    calls: int = field(init=False, default=0)
    arguments: list[str] = field(init=False, default_factory=list)  # each answered call's, as written
    dropping: bool = field(init=False, default=False)  # inside a call past the first, without parallel calls
    reader: CallReader | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.reader = tools.reader(self.tools, self.tool_name, self.parameters)
        if not self.reasoning:  # a forced call's grammar, too, starts after a reasoning
            self.phase = "answer"
        elif self.thinking:
            self.phase = "reasoning"

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        self.pending += text
        while self.pending:
            before = (self.phase, len(self.pending))
            self._advance(deltas)
            if (self.phase, len(self.pending)) == before:
                break
        return deltas

    def close(self) -> list[dict[str, Any]]:
        """The text still held and the end of any call."""
        deltas: list[dict[str, Any]] = []
        text, self.pending = self.pending, ""
        if self.phase == "reasoning":
            self._reason(text, deltas)
        elif text:
            self._answer(text, deltas)
        if self.reader is not None:
            self._pieces(self.reader.close(), deltas)
        if self.blank and not self.calls and not self.reasoned:
            deltas.append({"content": self.blank})
        return deltas

    def _advance(self, deltas: list[dict[str, Any]]) -> None:
        text = self.pending
        if self.phase == "start":  # does the answer open with <think>?
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.pending = stripped[len(THINK_OPEN) :]
                self.phase = "reasoning"
            elif not THINK_OPEN.startswith(stripped):
                self.phase = "answer"
        elif self.phase == "reasoning":
            at = text.find(THINK_CLOSE)
            if at >= 0:
                self._reason(text[:at], deltas)
                self.pending = text[at + len(THINK_CLOSE) :].lstrip("\n")
                self.phase = "answer"
            else:
                hold = held(text, (THINK_CLOSE,))
                self._reason(text[: len(text) - hold], deltas)
                self.pending = text[len(text) - hold :]
        else:
            self.pending = ""
            self._answer(text, deltas)

    def _reason(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text:
            self.reasoned = True
            deltas.append({"reasoning_content": text})

    def _answer(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if self.reader is None:
            self._content(text, deltas)
        else:
            self._pieces(self.reader.feed(text), deltas)

    def _content(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if not self.spoken and not text.strip():
            self.blank += text
            return
        if not self.spoken:
            text, self.blank, self.spoken = self.blank + text, "", True
        if deltas and "content" in deltas[-1]:
            deltas[-1]["content"] += text
        else:
            deltas.append({"content": text})

    def _pieces(self, pieces: list[Any], deltas: list[dict[str, Any]]) -> None:
        for piece in pieces:
            if isinstance(piece, Text):
                self._content(piece.text, deltas)
            elif isinstance(piece, CallStart):
                self.dropping = self.calls > 0 and not self.parallel
                if self.dropping:
                    continue
                call_id = piece.id or new_call_id(self.call_ids)
                function = {"name": piece.name, "arguments": ""}
                deltas.append(
                    {"tool_calls": [{"index": self.calls, "id": call_id, "type": "function", "function": function}]}
                )
                self.calls += 1
                self.arguments.append("")
            elif isinstance(piece, Arguments) and not self.dropping:
                self._arguments(piece.text, deltas)

    def calls_complete(self) -> bool:
        """Whether every call's arguments are whole JSON: a call the output ended inside (a stop
        sequence, an end token) is not."""
        return all(arguments_complete(a) for a in self.arguments)

    def _arguments(self, text: str, deltas: list[dict[str, Any]]) -> None:
        self.arguments[-1] += text
        last = deltas[-1]["tool_calls"][0] if deltas and "tool_calls" in deltas[-1] else None
        if last is not None and last["index"] == self.calls - 1:
            last["function"]["arguments"] += text
        else:
            deltas.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]})
