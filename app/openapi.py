"""The OpenAPI 3 document of the API, built from the request schemas (apispec's marshmallow plugin),
served at /openapi.json, and a browsable page of it at /docs (app/templates/docs.html), rendered on
the server without any script or asset from elsewhere.

Responses are described by hand (they are built by the formatters, not by schemas); every route of
the blueprint must be described (tests/test_openapi.py checks it against the app's URL map).
"""

from __future__ import annotations

from typing import Any

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint, Response, current_app, jsonify, render_template
from marshmallow import fields

from app import openapi_agents
from app.completions_format import CompletionLogprobs
from schemas.chat import ToolChoiceField
from schemas.completions import PromptField
from schemas.config import DeviceIds
from schemas.fields import (
    LogitBias,
    MessageContent,
    Metadata,
    StopField,
    TokenIdList,
    TokenIds,
)

bp = Blueprint("openapi", __name__)

ERRORS = {
    "400": "Invalid input; `param` names the field",
    "401": "Missing or wrong API key (when keys are configured)",
    "404": "Unknown model or route",
    "413": "Body over 4 MiB",
    "415": "Body not sent as application/json",
    "429": "Over the model's maxLinkNum (Retry-After)",
    "500": "The worker failed (generation_failed, out_of_memory)",
    "502": "The worker serving the request died (worker_lost)",
    "503": "Redis unavailable, no live worker, or queue_timeout (Retry-After)",
    "504": "The request's time limit or the token timeout passed",
}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
USAGE = {
    "type": "object",
    "properties": {name: {"type": "integer"} for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
}
TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
LOGPROB = {
    "type": "object",
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer"}},
        "top_logprobs": {"type": "array", "items": {"type": "object"}},
    },
}


def _completion(kind: str, choice: dict[str, Any], finish_reasons: list[str]) -> dict[str, Any]:
    """An OpenAI completion object (`object` = kind) whose choices carry `choice`'s properties."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [kind]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        **choice,
                        "finish_reason": {"type": "string", "enum": finish_reasons},
                        "stop_reason": {
                            "description": "vLLM's: the stop string or stop token id that ended the choice, else null",
                            "oneOf": [{"type": "string"}, {"type": "integer"}],
                            "nullable": True,
                        },
                    },
                },
            },
            "usage": USAGE,
        },
    }


RESPONSES: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "code": {"type": "string", "nullable": True},
                },
            }
        },
    },
    "ChatCompletion": _completion(
        "chat.completion",
        {
            "message": {
                "type": "object",
                "properties": {
                    "role": {"type": "string"},
                    "content": {"type": "string", "nullable": True},
                    "reasoning_content": {"type": "string", "nullable": True},
                    "tool_calls": {"type": "array", "items": TOOL_CALL},
                },
            },
            "logprobs": {
                "type": "object",
                "nullable": True,
                "properties": {"content": {"type": "array", "items": LOGPROB}},
            },
        },
        ["stop", "length", "tool_calls"],
    ),
    "Completion": _completion(
        "text_completion",
        {
            "text": {"type": "string"},
            "logprobs": {
                "type": "object",
                "nullable": True,
                "properties": {key: {"type": "array", "items": {}} for key in CompletionLogprobs(None).body},
            },
        },
        ["stop", "length"],
    ),
    "Generated": {
        "type": "object",
        "description": "generateStyle mindie: the generated text; vllm: a list holding prompt + generated text",
        "properties": {"text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}},
    },
    "Model": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["model"]},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
            "quantization": {
                "type": "string",
                "nullable": True,
                "description": "the scheme the weights run with, e.g. w8a8_dynamic (msmodelslim); null: float",
            },
        },
    },
    "ModelList": {
        "type": "object",
        "properties": {
            "object": {"type": "string"},
            "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}},
        },
    },
    "Tokens": {
        "type": "object",
        "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"}, "tokens": TOKEN_IDS},
    },
    "Text": {"type": "object", "properties": {"prompt": {"type": "string"}}},
    "Health": {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["ok", "unavailable"]},
            "redis": {"type": "string"},
            "workers": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    },
}


def _field_properties(self: Any, field: fields.Field, **kwargs: Any) -> dict[str, Any]:
    """OpenAPI types of tokenline's own fields (apispec knows marshmallow's)."""
    agents = openapi_agents.field_properties(field)
    if agents:
        return agents
    if isinstance(field, StopField):
        return {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": field.max_items}]
        }
    if isinstance(field, (TokenIds, TokenIdList)):
        return dict(TOKEN_IDS)
    if isinstance(field, LogitBias):
        return {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
    if isinstance(field, MessageContent):
        text = {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}
        body = {"type": {"type": "string", "enum": ["text"]}, "body": {"type": "string"}}  # the provider form
        part = {
            "oneOf": [
                {"type": "object", "properties": text, "required": ["type", "text"], "additionalProperties": False},
                {"type": "object", "properties": body, "required": ["type", "body"], "additionalProperties": False},
            ]
        }
        return {"oneOf": [{"type": "string"}, {"type": "array", "items": part}], "nullable": True}
    if isinstance(field, PromptField):
        options = [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, TOKEN_IDS]
        return {"oneOf": [*options, {"type": "array", "items": TOKEN_IDS}]}
    if isinstance(field, ToolChoiceField):
        named = {"type": "object", "properties": {"type": {"type": "string"}, "function": {"type": "object"}}}
        allowed = {"type": "object", "properties": {"type": {"type": "string"}, "allowed_tools": {"type": "object"}}}
        return {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, named, allowed]}
    if isinstance(field, Metadata):
        values = {"type": "string", "maxLength": field.value_length}
        return {"type": "object", "maxProperties": field.pairs, "additionalProperties": values, "nullable": True}
    if isinstance(field, DeviceIds):
        return {"type": "array"}
    return {}


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}


def _operation(summary: str, request: str | None, response: str, stream: str | None = None) -> dict[str, Any]:
    content = _json(response)
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": stream}}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": content},
            **{code: {"description": text, "content": _json("Error")} for code, text in ERRORS.items()},
        },
    }
    if request:
        operation["requestBody"] = {"required": True, "content": _json(request)}
    return operation


def build_spec(service: Any, extensions: dict[str, Any] | None = None) -> dict[str, Any]:
    plugin = MarshmallowPlugin()
    spec = APISpec(title="tokenline", version="1", openapi_version="3.0.3", plugins=[plugin])
    plugin.converter.add_attribute_function(_field_properties)  # type: ignore[union-attr]
    for name, schema in (
        ("ChatCompletionRequest", service.chat_schema),
        ("CompletionRequest", service.completion_schema),
        ("GenerateRequest", service.generate_schema),
        ("TokenizeRequest", service.tokenize_schema),
        ("DetokenizeRequest", service.detokenize_schema),
        *openapi_agents.request_schemas(extensions or {}),
    ):
        spec.components.schema(name, schema=schema)
    for name, body in {**RESPONSES, **openapi_agents.SCHEMAS}.items():
        spec.components.schema(name, body)
    sse = "Server-sent events (stream: true): chunks, then `data: [DONE]`"
    paths = {
        "/v1/chat/completions": {
            "post": _operation("OpenAI chat completions", "ChatCompletionRequest", "ChatCompletion", sse)
        },
        "/v1/completions": {"post": _operation("OpenAI completions", "CompletionRequest", "Completion", sse)},
        "/generate": {
            "post": _operation(
                "vLLM-style generation", "GenerateRequest", "Generated", "JSON objects, each followed by '\\0'"
            )
        },
        "/v1/models": {"get": _operation("The served models", None, "ModelList")},
        "/v1/models/{model_id}": {
            "get": {
                **_operation("One served model", None, "Model"),
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            }
        },
        "/tokenize": {"post": _operation("Token ids of a prompt or a conversation", "TokenizeRequest", "Tokens")},
        "/detokenize": {"post": _operation("Text of token ids", "DetokenizeRequest", "Text")},
        "/health": {"get": _operation("Redis and live workers per model (503 when Redis is away)", None, "Health")},
        "/health/live": {"get": _operation("Liveness: the API process serves HTTP", None, "Health")},
        "/health/ready": {
            "get": _operation("Readiness: Redis answers and some model has a live worker (else 503)", None, "Health")
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics of the API and every engine worker",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {"description": "OpenAPI 3"}}}},
        "/docs": {"get": {"summary": "This document as a page", "responses": {"200": {"description": "HTML"}}}},
    }
    paths.update(openapi_agents.paths(_operation))
    for path, operations in paths.items():
        spec.path(path=path, operations=operations)
    return spec.to_dict()


def _spec() -> dict[str, Any]:
    extensions = current_app.extensions
    if "tokenline.openapi" not in extensions:
        extensions["tokenline.openapi"] = build_spec(extensions["tokenline"], extensions)
    return extensions["tokenline.openapi"]


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(_spec())


@bp.get("/docs")
def docs() -> str:
    return render_template("docs.html", spec=_spec())
