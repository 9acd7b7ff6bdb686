"""Chat template and tokenization in the API, from the model directory, without torch.

The template is rendered the way transformers' apply_chat_template renders it (sandboxed Jinja,
trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a non-ASCII `tojson`), and the
text is encoded with the model's fast tokenizer (`tokenizers`), so the worker sees the same ids.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from schemas.errors import InvalidRequest
from schemas.model_files import ModelFiles
from schemas.requests import Message


class TemplateRaised(Exception):
    """A chat template called raise_exception(): the conversation is not one the model accepts."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class PromptBuilder:
    def __init__(self, files: ModelFiles) -> None:
        self.tokenizer = Tokenizer.from_file(str(files.tokenizer_file))
        self.bos_token = files.special_token("bos_token")
        self.eos_token = files.special_token("eos_token")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = files.chat_template
        self.template = env.from_string(template) if template else None

    def chat_prompt(self, messages: tuple[Message, ...]) -> str:
        if self.template is None:
            raise InvalidRequest("This model has no chat template; use /generate.", param="messages")
        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=None,
            )
        except TemplateRaised as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        except TemplateError as exc:
            raise InvalidRequest(f"The chat template failed on these messages: {exc}", param="messages") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
