"""Chat template and tokenization in the API, from the model directory, without torch.

The template is rendered the way transformers' apply_chat_template renders it (sandboxed Jinja,
trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a non-ASCII `tojson`), and the
text is encoded with the model's fast tokenizer (`tokenizers`), so the worker sees the same ids.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import cached_property
from typing import Any

from jinja2 import Template, TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from schemas.chat import ChatRequest, Message, Tool
from schemas.errors import InvalidRequest
from schemas.model_files import ModelFiles, ModelFilesError
from schemas.vocabulary import Vocabulary

# Names a template reads that the server sets itself: chat_template_kwargs may not replace them.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class TemplateRaised(Exception):
    """A chat template called raise_exception(): the conversation is not one the model accepts."""


class TemplateRefused(InvalidRequest):
    """The chat template failed on a request's messages (its own raise_exception, or an error it hit):
    a 400 naming `messages`, which the APIs that build the messages from other fields may rename."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationTags(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers marks the assistant's tokens with it for
    training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def compiled_template(files: ModelFiles) -> Template | None:
    """The model's chat template compiled as transformers' apply_chat_template compiles it; None
    without one. ModelFilesError, naming its file, where it does not compile (the gunicorn master
    calls this at start-up, so that such a template stops the API with one line)."""
    text = files.chat_template
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationTags])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text) if text else None
    except TemplateSyntaxError as exc:
        raise ModelFilesError(
            f"the chat template in {files.chat_template_file} does not compile: {exc} (line {exc.lineno})"
        ) from None


class PromptBuilder:
    def __init__(self, files: ModelFiles) -> None:
        self.tokenizer = Tokenizer.from_file(str(files.tokenizer_file))
        # Its added tokens (text → id), which llguidance reads as special tokens whatever their flag: a
        # grammar names such a token as a token, not as text.
        self.added_tokens = {token.content: id for id, token in self.tokenizer.get_added_tokens_decoder().items()}
        self.bos_token = files.special_token("bos_token")
        self.eos_token = files.special_token("eos_token")
        self.template_text = files.chat_template
        self.template = compiled_template(files)

    def chat_prompt(
        self,
        messages: tuple[Message, ...],
        tools: tuple[Tool, ...] = (),
        kwargs: dict[str, Any] | None = None,
        generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> str:
        """The conversation rendered by the model's template; tools and chat_template_kwargs (say,
        Qwen3's enable_thinking) reach it as transformers' apply_chat_template passes them. Without
        `generation_prompt` it ends after the last message, without the assistant turn's opening;
        with `continue_final` it ends with the final message's text, for the model to continue."""
        if self.template is None:
            raise InvalidRequest(
                "This model has no chat template; send a plain prompt to /v1/completions or /generate.",
                param="messages",
            )
        extra = dict(kwargs or {})
        clash = RESERVED.intersection(extra)
        if clash:
            raise InvalidRequest(
                f"chat_template_kwargs: {sorted(clash)[0]!r} is set by the server.", param="chat_template_kwargs"
            )
        try:
            rendered = self.template.render(
                **extra,
                messages=[m.for_template() for m in messages],
                add_generation_prompt=generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=[t.for_template() for t in tools] or None,
            )
        except TemplateRaised as exc:
            raise TemplateRefused(str(exc), param="messages") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, RecursionError) as exc:
            raise TemplateRefused(
                f"The chat template failed on these messages: {type(exc).__name__}: {exc}", param="messages"
            ) from None
        return _cut_after(rendered, messages[-1].content or "") if continue_final else rendered

    def request_prompt(self, chat: ChatRequest) -> str:
        """The prompt of a chat request: its conversation, tools and template arguments, rendered as it asks."""
        return self.chat_prompt(
            chat.messages, chat.tools, chat.template_kwargs, chat.generation_prompt, chat.continue_final
        )

    def system_refused(self, chat: ChatRequest, exc: InvalidRequest, field: str) -> InvalidRequest:
        """`exc` for a chat request whose first, system message the client gave as `field` (Responses'
        `instructions`, Messages' `system`): a template refusal is named as that field where the
        template takes the conversation without it (a model with no system role), else kept."""
        if not isinstance(exc, TemplateRefused) or not chat.messages or chat.messages[0].role != "system":
            return exc
        try:
            self.request_prompt(dataclasses.replace(chat, messages=chat.messages[1:]))
        except InvalidRequest:
            return exc
        return TemplateRefused(exc.message, param=field, code=exc.code)

    @cached_property
    def vocabulary(self) -> Vocabulary:
        """Each token's bytes (the logprobs' `bytes`: a piece of a character is its own bytes, not
        U+FFFD's), read from the tokenizer as logprobs name each token."""
        return Vocabulary.of(self.tokenizer, on_demand=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _cut_after(rendered: str, final: str) -> str:
    """The rendering cut right after the final message's text (transformers' continue_final_message):
    at its last occurrence, looked for without the whitespace a template may trim from its ends, and
    kept with its trailing whitespace where the template kept that too."""
    core = final.strip()
    at = rendered.rfind(core)
    if not core or at < 0:
        raise TemplateRefused(
            "The chat template does not render the final message's text as it is, so it cannot be "
            "continued (continue_final_message).",
            param="messages",
        )
    kept = final.lstrip()
    return rendered[: at + (len(kept) if rendered.startswith(kept, at) else len(core))]
