"""The OpenAPI description of the agents' APIs (OpenAI Responses, Anthropic Messages): their request
schemas' own fields, their response bodies, and their paths; app/openapi.py merges them in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from marshmallow import fields

from schemas import messages
from schemas.fields import Refused
from schemas.response_items import InputField
from schemas.responses import ResponsesToolChoice, ToolsField

OBJECT = {"type": "object"}
RESPONSES_SSE = (
    "Server-sent events (stream: true), each `event: <type>` with a JSON `data` carrying `sequence_number`: "
    "response.created, response.in_progress, response.output_item.added, response.content_part.added, "
    "response.output_text.delta / .done, response.reasoning_text.delta / .done, "
    "response.function_call_arguments.delta / .done, response.content_part.done, response.output_item.done, "
    "then response.completed, response.incomplete or response.failed"
)
MESSAGES_SSE = (
    "Server-sent events (stream: true), each `event: <type>` with a JSON `data`: message_start, then per "
    "content block content_block_start, content_block_delta (text_delta, thinking_delta, input_json_delta), "
    "content_block_stop, then message_delta (stop_reason, usage) and message_stop; `ping` while waiting, "
    "`error` on a failure"
)
ANTHROPIC_ERRORS = {
    "400": "invalid_request_error: the message names the field",
    "401": "authentication_error (x-api-key or Authorization: Bearer, when keys are configured)",
    "404": "not_found_error: unknown model",
    "413": "request_too_large",
    "429": "rate_limit_error (Retry-After)",
    "500": "api_error: the worker failed",
    "503": "overloaded_error: no live worker or Redis away (Retry-After)",
}
RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]

SCHEMAS: dict[str, dict[str, Any]] = {
    "Response": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response"]},
            "created_at": {"type": "integer"},
            "completed_at": {"type": "integer", "description": "on a completed response"},
            "status": {
                "type": "string",
                "enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"],
            },
            "error": {"type": "object", "nullable": True},
            "incomplete_details": {"type": "object", "nullable": True},
            "model": {"type": "string"},
            "output": {
                "type": "array",
                "description": "items of type message (output_text parts), reasoning, function_call",
                "items": OBJECT,
            },
            "previous_response_id": {"type": "string", "nullable": True},
            "store": {"type": "boolean"},
            "usage": {
                "type": "object",
                "nullable": True,
                "properties": {name: {"type": "integer"} for name in ("input_tokens", "output_tokens", "total_tokens")},
            },
        },
    },
    "ResponseDeleted": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response.deleted"]},
            "deleted": {"type": "boolean"},
        },
    },
    "MessagesResponse": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]},
            "model": {"type": "string"},
            "content": {"type": "array", "description": "text, thinking and tool_use blocks", "items": OBJECT},
            "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
            "stop_sequence": {"type": "string", "nullable": True},
            "usage": {
                "type": "object",
                "properties": {name: {"type": "integer"} for name in ("input_tokens", "output_tokens")},
            },
        },
    },
    "MessageTokens": {"type": "object", "properties": {"input_tokens": {"type": "integer"}}},
    "AnthropicError": {
        "type": "object",
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
            "request_id": {"type": "string"},
        },
    },
    "InputItemList": {
        "type": "object",
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": OBJECT},
            "first_id": {"type": "string", "nullable": True},
            "last_id": {"type": "string", "nullable": True},
            "has_more": {"type": "boolean"},
        },
    },
}


def field_properties(field: fields.Field) -> dict[str, Any]:
    """OpenAPI types of the agents' APIs' own fields ({} for a field that is not one of them)."""
    if isinstance(field, InputField):
        return {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}]}
    if isinstance(field, messages.ContentField):
        return {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}]}
    if isinstance(field, messages.TextField):
        return {"oneOf": [{"type": "string"}, {"type": "array", "items": OBJECT}], "nullable": True}
    if isinstance(field, messages.ToolsField):
        return {"type": "array", "items": OBJECT, "maxItems": 128, "description": "custom (client) tools only"}
    if isinstance(field, ToolsField):
        return {"type": "array", "items": OBJECT, "maxItems": 128, "description": "function tools only"}
    if isinstance(field, ResponsesToolChoice):
        return {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, OBJECT]}
    if isinstance(field, Refused):
        allowed: list[Any] = []
        for value in field.allowed:  # 1.0 and 1 (an integer sent for a float) are one JSON value
            if not isinstance(value, list) and value not in allowed:
                allowed.append(value)
        return {
            "description": f"not supported: {field.what}",
            "nullable": True,
            **({"enum": allowed} if allowed else {}),
        }
    return {}


def request_schemas(extensions: dict[str, Any]) -> list[tuple[str, Any]]:
    """The request schemas of the agents' APIs that the app serves."""
    found = []
    if "tokenline.responses" in extensions:
        found.append(("ResponsesRequest", extensions["tokenline.responses"].schema))
    if "tokenline.messages" in extensions:
        api = extensions["tokenline.messages"]
        found += [("MessagesRequest", api.schema), ("CountTokensRequest", api.count_schema)]
    return found


def paths(operation: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The paths, with `operation(summary, request, response, stream=None)` as app/openapi.py builds them."""

    def on_response(summary: str, response: str) -> dict[str, Any]:
        return {**operation(summary, None, response), "parameters": RESPONSE_ID}

    return {
        "/v1/responses": {
            "post": operation(
                "OpenAI Responses: create (stored unless store is false)", "ResponsesRequest", "Response", RESPONSES_SSE
            )
        },
        "/v1/responses/{response_id}": {
            "get": on_response("A stored response (404 for another API key's)", "Response"),
            "delete": on_response(
                "Delete a stored response (a running background one is cancelled)", "ResponseDeleted"
            ),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": on_response("A stored response's input items (order, after, limit)", "InputItemList")
        },
        "/v1/responses/{response_id}/cancel": {
            "post": on_response(
                "Cancel a queued or in-progress background response (a cancelled one: as it is; any other: 400)",
                "Response",
            )
        },
        "/v1/messages": {
            "post": anthropic(operation("Anthropic Messages", "MessagesRequest", "MessagesResponse", MESSAGES_SSE))
        },
        "/v1/messages/count_tokens": {
            "post": anthropic(
                operation("Anthropic Messages: count a request's input tokens", "CountTokensRequest", "MessageTokens")
            )
        },
    }


def anthropic(operation: dict[str, Any]) -> dict[str, Any]:
    """An operation whose errors are in Anthropic's envelope."""
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}
    errors = {code: {"description": text, "content": content} for code, text in ANTHROPIC_ERRORS.items()}
    return {**operation, "responses": {"200": operation["responses"]["200"], **errors}}
