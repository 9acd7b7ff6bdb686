"""The tool-call formats of the model families tokenline serves, each detected from the chat template
that teaches it (docs/models.md has the table), and the reader of each:

- hermes (Qwen2.5, Qwen3, QwQ, Hermes, granite 4): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
- qwen3_coder (Qwen3-Coder, Qwen3.5, Nemotron 3 Nano): `<function=name><parameter=k>…` (app/tools/xml.py);
- llama3_json (Llama 3.x): `{"name": …, "parameters": {…}}` as the answer, maybe after `<|python_tag|>`;
- mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}]`, or `[TOOL_CALLS]name[ARGS]{…}` per call;
- deepseek_v3 (V3, R1): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` and a ```json fence;
- deepseek_v31: `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{…}<｜tool▁call▁end｜>`;
- kimi_k2: `<|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{…}<|tool_call_end|>`;
- granite (3.x), phi4_mini: `<|tool_call|>[{"name": …, "arguments": {…}}]`, Phi-4-mini's closed by `<|/tool_call|>`;
- nemotron (Nemotron Nano 2): `<TOOLCALL>[{"name": …, "arguments": {…}}]</TOOLCALL>`;
- functionary_v31: `<function=name>{…}</function>`;
- functionary_v32: `name\n{…}` after the prompt's `>>>`, `>>>` between parts, `all\n` before words;
- gemma4: `<|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>` (app/tools/gemma.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from app.tools.bodies import ArgumentsBody
from app.tools.framed import FramedCalls, Framing
from app.tools.gemma import GemmaCalls
from app.tools.pieces import CallReader, Piece
from app.tools.xml import XmlCalls
from schemas.guided import CallBlock

NAME = r"[A-Za-z0-9_.:-]+"

HERMES = Framing(
    "<tool_call>",
    header=re.compile(r"<tool_call>"),
    header_start="<tool_call>",
    keep_opener=True,
    closer=("</tool_call>",),
)
LLAMA3_JSON = Framing("<|python_tag|>", separator=";", at_start=True, bare=True)
MISTRAL_ARRAY = Framing("[TOOL_CALLS]", begin="[", separator=",", end=("]",))
MISTRAL_NAMED = Framing(
    "[TOOL_CALLS]",
    header=re.compile(rf"\[TOOL_CALLS\]\s*(?P<name>{NAME})\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]*\s*)?\[ARGS\]"),
    header_start="[TOOL_CALLS]",
    keep_opener=True,
)
DEEPSEEK_V3 = Framing(
    "<｜tool▁calls▁begin｜>",
    header=re.compile(rf"<｜tool▁call▁begin｜>\s*\w*\s*<｜tool▁sep｜>\s*(?P<name>{NAME})\s*\n```(?:json)?\s*\n"),
    header_start="<｜tool▁call▁begin｜>",
    closer=("```", "<｜tool▁call▁end｜>"),
    end=("<｜tool▁calls▁end｜>",),
)
DEEPSEEK_V31 = Framing(
    "<｜tool▁calls▁begin｜>",
    header=re.compile(rf"<｜tool▁call▁begin｜>\s*(?P<name>{NAME})\s*<｜tool▁sep｜>"),
    header_start="<｜tool▁call▁begin｜>",
    closer=("<｜tool▁call▁end｜>",),
    end=("<｜tool▁calls▁end｜>",),
)
KIMI_K2 = Framing(
    "<|tool_calls_section_begin|>",
    header=re.compile(
        r"<\|tool_call_begin\|>\s*(?P<id>(?:functions\.)?(?P<name>[A-Za-z0-9_.-]+?):\d+)\s*<\|tool_call_argument_begin\|>"
    ),
    header_start="<|tool_call_begin|>",
    closer=("<|tool_call_end|>",),
    end=("<|tool_calls_section_end|>",),
)
TOOL_CALL_TOKEN = Framing("<|tool_call|>", begin="[", separator=",", end=("]", "<|/tool_call|>"))
NEMOTRON = Framing("<TOOLCALL>", begin="[", separator=",", end=("]", "</TOOLCALL>"))
FUNCTIONARY_V31 = Framing(
    "<function=",
    header=re.compile(rf"<function=(?P<name>{NAME})>"),
    header_start="<function=",
    keep_opener=True,
    closer=("</function>",),
)
FUNCTIONARY_V32 = Framing(">>>", header=re.compile(rf">>>(?P<name>{NAME})\n"), header_start=">>>", keep_opener=True)
# tool_choice "required": the grammar of schemas/guided.py, a JSON array of {"name", "parameters"}.
REQUIRED = Framing("", begin="[", separator=",", end=("]",), forced=True, keys=("parameters", "arguments"))

FRAMINGS = {
    "hermes": HERMES,
    "llama3_json": LLAMA3_JSON,
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V31,
    "kimi_k2": KIMI_K2,
    "granite": TOOL_CALL_TOKEN,
    "phi4_mini": TOOL_CALL_TOKEN,
    "nemotron": NEMOTRON,
    "functionary_v31": FUNCTIONARY_V31,
    "required": REQUIRED,
}
FORMATS = (*FRAMINGS, "mistral", "functionary_v32", "qwen3_coder", "gemma4")  # what a model may write; plus "named"


class CallTag(NamedTuple):
    """How a format writes its calls, for a grammar that holds each to its tool's schema (schemas/guided.py's
    CallBlock): a block of calls begins with the trigger (the text that begins any block) and `begin`,
    holds one call (or, with a `separator`, a list of them), each the `opening` of a call of the function
    named (with `numbered`, an index and that text after it), its arguments as JSON and `close`, and
    ends with `end`. With `whole`, the calls are the whole answer, the trigger optional before them,
    each a JSON object `{"name": …, whole: arguments}` (Llama 3's). With `spaced`, whitespace may come
    after the trigger, between calls and before the end (the format's parsers take it)."""

    trigger: str
    begin: str
    opening: Callable[[str], str]
    close: str
    end: str
    separator: str | None = None
    numbered: str | None = None
    whole: str | None = None
    spaced: bool = False

    def block(self, tools: Iterable[tuple[str, dict[str, Any], bool]], tokens: Mapping[str, int]) -> CallBlock:
        """The grammar's description of a block of calls of `tools` (name, parameters, strict) as this
        format writes them, over a tokenizer whose added tokens are `tokens` (text → id)."""
        calls = tuple((name, self.opening(name), parameters, strict) for name, parameters, strict in tools)
        return CallBlock(
            self.trigger, self.begin, calls, self.close, self.end, self.separator, tokens, self.numbered, self.whole,
            self.spaced,
        )  # fmt: skip


def _named(name: str) -> str:
    return f'{{"name": {json.dumps(name)}, "arguments": '


# The formats whose calls a strict tool's grammar constrains under tool_choice auto (call_tag picks
# Mistral's by its template); the other formats' calls are read as the model writes them.
STRICT_CALLS = {
    "hermes": CallTag("<tool_call>", "\n", _named, "}", "\n</tool_call>"),
    "functionary_v31": CallTag("<function=", "", lambda name: f"{name}>", "", "</function>"),
    "granite": CallTag("<|tool_call|>", "[", _named, "}", "]", separator=", "),
    "phi4_mini": CallTag("<|tool_call|>", "[", _named, "}", "]<|/tool_call|>", separator=", "),
    "nemotron": CallTag("<TOOLCALL>", "[", _named, "}", "]</TOOLCALL>", separator=", "),
    "deepseek_v3": CallTag(
        "<｜tool▁calls▁begin｜>",
        "",
        lambda name: f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
        "\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        separator="",
        spaced=True,
    ),
    "deepseek_v31": CallTag(
        "<｜tool▁calls▁begin｜>",
        "",
        lambda name: f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        separator="",
        spaced=True,
    ),
    "kimi_k2": CallTag(
        "<|tool_calls_section_begin|>",
        "",
        lambda name: f"<|tool_call_begin|>functions.{name}:",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        separator="",
        numbered="<|tool_call_argument_begin|>",
        spaced=True,
    ),
    "llama3_json": CallTag(
        "<|python_tag|>",
        "",
        lambda name: f'{{"name": {json.dumps(name)}, "parameters": ',
        "}",
        "",
        separator="; ",
        whole="parameters",
    ),
    # Mistral's tokenizers up to v3 (Nemo): one list of calls; v11 and later: `name[ARGS]{…}` a call.
    "mistral": CallTag("[TOOL_CALLS]", "[", _named, "}", "]", separator=", ", spaced=True),
    "mistral_named": CallTag("[TOOL_CALLS]", "", lambda name: f"{name}[ARGS]", "", ""),
}


def call_tag(format: str, template: str | None) -> CallTag | None:
    """How a model of `format` taught by `template` writes its calls, where a grammar can hold them."""
    if format == "mistral" and "[ARGS]" in (template or ""):
        return STRICT_CALLS["mistral_named"]
    return STRICT_CALLS.get(format)


class MistralCalls(FramedCalls):
    """`[TOOL_CALLS]` and then a JSON array of calls (tokenizers up to v3), or `name[ARGS]{…}` for each
    call (v11 and later, `[CALL_ID]…` allowed before `[ARGS]`)."""

    def __init__(self) -> None:
        super().__init__(MISTRAL_NAMED)

    def _enter(self) -> None:
        self.framing = MISTRAL_NAMED
        super()._enter()

    def _begin(self, pieces: list[Piece]) -> bool:
        if self.framing is MISTRAL_NAMED:
            after = self.buffer[len(MISTRAL_NAMED.opener) :].lstrip()
            if not after:
                return False
            if after.startswith("["):
                self.framing = MISTRAL_ARRAY
                self._take(len(MISTRAL_ARRAY.opener))
        return super()._begin(pieces)


class FunctionaryV32(FramedCalls):
    """functionary v3.2: the prompt ends with `>>>`, so the output starts with a recipient and a
    newline: `all` for words to the user, else the function whose arguments follow."""

    RECIPIENT = re.compile(rf"(?P<name>{NAME})\n")

    def __init__(self) -> None:
        super().__init__(FUNCTIONARY_V32)
        self.state = "recipient"

    def _recipient(self, pieces: list[Piece]) -> bool:
        match = self.RECIPIENT.match(self.buffer)
        if match is None:
            if re.fullmatch(NAME, self.buffer) and len(self.buffer) < 64:
                return False  # the recipient is still coming
            self.state = "content"
            return True
        return self._to(match.group("name"), match.end())

    def _call(self, pieces: list[Piece]) -> bool:
        match = self.framing.header.match(self.buffer) if self.framing.header else None
        if match is not None and match.group("name") == "all":
            return self._to("all", match.end())
        return super()._call(pieces)

    def _to(self, recipient: str, length: int) -> bool:
        self._take(length)
        if recipient == "all":
            self.raw, self.state = "", "content"
        else:
            self.body, self.state = ArgumentsBody(recipient), "body"
        return True


class NamedCall:
    """tool_choice naming a function: the output is that function's arguments (schemas/guided.py)."""

    def __init__(self, name: str) -> None:
        self.body = ArgumentsBody(name)
        self.ended = False

    def feed(self, text: str) -> list[Piece]:
        if self.ended:
            return []
        pieces, rest = self.body.feed(text)
        self.ended = rest is not None or self.body.failed
        return pieces

    def close(self) -> list[Piece]:
        return []


def reader(format: str, tool_name: str | None = None, tools: Mapping[str, Any] | None = None) -> CallReader | None:
    """The reader of a choice's calls in `format` ("named" and "required" for the forced choices);
    None for "none". `tools` (name → parameters schema) types the values of formats that write
    arguments as text."""
    if format in FRAMINGS:
        return FramedCalls(FRAMINGS[format])
    if format == "mistral":
        return MistralCalls()
    if format == "functionary_v32":
        return FunctionaryV32()
    if format == "qwen3_coder":
        return XmlCalls(tools or {})
    if format == "gemma4":
        return GemmaCalls()
    if format == "named":
        return NamedCall(tool_name or "")
    return None


def detect(template: str | None) -> str:
    """The tool-call format a chat template teaches its model, or "none". The more specific
    markers are looked for first: Qwen3-Coder's template also has `<tool_call>`, functionary v3.1's
    also Llama's `<|python_tag|>`."""
    text = template or ""
    for marker, format in (
        ("<｜tool▁calls▁begin｜>", "deepseek_v3" if "```json" in text else "deepseek_v31"),
        ("<|tool_calls_section_begin|>", "kimi_k2"),
        ("<|tool_call>", "gemma4"),
        ("<TOOLCALL>", "nemotron"),
        ("<|tool_call|>", "granite"),
        ("<|/tool|>", "phi4_mini"),
        ("<parameter=", "qwen3_coder"),
        (">>>", "functionary_v32"),
        ("<function=", "functionary_v31"),
        ("<tool_call>", "hermes"),
        ("[TOOL_CALLS]", "mistral"),
        ("<|python_tag|>", "llama3_json"),
    ):
        if marker in text:
            return format
    if "ipython" in text and "<|start_header_id|>" in text:  # Llama 3.2's template has no python tag
        return "llama3_json"
    return "none"
