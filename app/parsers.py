"""What a model writes, split the way OpenAI clients read it: reasoning, content and tool calls.

One `ChoiceParser` per choice takes the text as it streams (`feed`) and answers the deltas that are
safe to send: text that could be the start of a tag is held back until the next piece settles it.
`close` answers the rest and the tool calls. The formats:

- reasoning "think": `<think>…</think>` before the answer (Qwen3, QwQ, DeepSeek-R1); when the chat
  template already opened the tag in the prompt, the output starts inside it.
- tools "hermes" (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
  one or more; "mistral": `[TOOL_CALLS][{"name": …, "arguments": {…}}]` or `[TOOL_CALLS]name[ARGS]{…}`;
  "llama3_json": the answer is `{"name": …, "parameters": {…}}` (optionally after `<|python_tag|>`,
  several separated by `;`).
- forced calls (schemas/guided.py): "named" — the output is the named function's arguments;
  "required" — a JSON array of `{"name", "parameters"}`.
A tool section that does not parse is returned as content, as vLLM does.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def detect_tool_parser(template: str | None) -> str:
    """The tool-call format a chat template teaches its model, or "none"."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "none"


def detect_reasoning_parser(template: str | None) -> str:
    return "think" if THINK_CLOSE in (template or "") else "none"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `tags`."""
    for length in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-length:]) for t in tags):
            return length
    return 0


@dataclass
class ChoiceParser:
    reasoning: bool = False  # the model thinks in <think>…</think>
    thinking: bool = False  # the prompt already opened <think>
    tools: str = "none"  # none, hermes, mistral, llama3_json, named, required
    tool_name: str | None = None
    phase: str = field(init=False, default="start")  # start, reasoning, content, tools
    pending: str = field(init=False, default="")
    tool_text: str = field(init=False, default="")
    seen_content: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.tools in ("named", "required"):
            self.phase = "tools"
        elif self.reasoning and self.thinking:
            self.phase = "reasoning"
        elif not self.reasoning:
            self.phase = "content"

    def feed(self, text: str) -> list[dict[str, str]]:
        deltas: list[dict[str, str]] = []
        self.pending += text
        while self.pending:
            before = (self.phase, len(self.pending))
            self._advance(deltas)
            if (self.phase, len(self.pending)) == before:
                break
        return [d for d in deltas if next(iter(d.values()))]

    def _advance(self, deltas: list[dict[str, str]]) -> None:
        text = self.pending
        if self.phase == "tools":
            self.tool_text += text
            self.pending = ""
        elif self.phase == "start":  # does the answer open with <think>?
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.pending = stripped[len(THINK_OPEN) :]
                self.phase = "reasoning"
            elif not THINK_OPEN.startswith(stripped):
                self.phase = "content"
        elif self.phase == "reasoning":
            at = text.find(THINK_CLOSE)
            if at >= 0:
                deltas.append({"reasoning_content": text[:at]})
                self.pending = text[at + len(THINK_CLOSE) :].lstrip("\n")
                self.phase = "content"
            else:
                hold = _held(text, (THINK_CLOSE,))
                deltas.append({"reasoning_content": text[: len(text) - hold]})
                self.pending = text[len(text) - hold :]
        else:
            self._content(text, deltas)

    def _content(self, text: str, deltas: list[dict[str, str]]) -> None:
        marker = TOOL_MARKERS.get(self.tools)
        if self.tools == "llama3_json" and not self.seen_content:
            stripped = text.lstrip()
            if not stripped:
                return
            if stripped.startswith(("{", "<|python_tag|>")):
                self.phase, self.tool_text, self.pending = "tools", stripped, ""
                return
            if "<|python_tag|>".startswith(stripped):
                return  # wait: it may become the tag
        if marker is not None:
            at = text.find(marker)
            if at >= 0:
                deltas.append({"content": text[:at]})
                self.seen_content = self.seen_content or bool(text[:at].strip())
                self.phase, self.tool_text, self.pending = "tools", text[at:], ""
                return
            hold = _held(text, (marker,))
        else:
            hold = 0
        deltas.append({"content": text[: len(text) - hold]})
        self.seen_content = self.seen_content or bool(text[: len(text) - hold].strip())
        self.pending = text[len(text) - hold :]

    def close(self) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
        """The text still held, and the tool calls (an empty list when there are none)."""
        deltas: list[dict[str, str]] = []
        if self.pending:
            key = "reasoning_content" if self.phase in ("reasoning",) else "content"
            if self.phase == "tools":
                self.tool_text += self.pending
            else:
                deltas.append({key: self.pending})
            self.pending = ""
        if not self.tool_text:
            return deltas, []
        calls = self._calls(self.tool_text)
        if calls is None:  # not what the format promised: the model's words, as they were
            deltas.append({"content": self.tool_text})
            return deltas, []
        return deltas, [
            {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        try:
            if self.tools == "named":
                return [(self.tool_name or "", text)]
            if self.tools == "required":
                return [_call(c, "parameters") for c in _json_list(text)]
            if self.tools == "hermes":
                return [_call(json.loads(body), "arguments") for body in _HERMES_CALL.findall(text)] or None
            if self.tools == "mistral":
                return _mistral(text[len("[TOOL_CALLS]") :].strip())
            if self.tools == "llama3_json":
                body = text.removeprefix("<|python_tag|>").strip()
                return [_call(json.loads(part), "parameters") for part in body.split(";") if part.strip()]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return None


def _json_list(text: str) -> list[Any]:
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


def _call(value: Any, key: str) -> tuple[str, str]:
    """(name, arguments as a JSON string) from {"name": …, key: {…}} (or "arguments"/"parameters")."""
    name = value["name"]
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(name, str):
        raise TypeError("name")
    return name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _mistral(text: str) -> list[tuple[str, str]]:
    if "[ARGS]" in text:  # v11 tokenizers: name[ARGS]{…}, repeated with [TOOL_CALLS]
        calls = []
        for part in text.split("[TOOL_CALLS]"):
            name, _, arguments = part.partition("[ARGS]")
            json.loads(arguments)
            calls.append((name.strip(), arguments.strip()))
        return calls
    return [_call(c, "arguments") for c in _json_list(text)]
