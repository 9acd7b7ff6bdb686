"""The OpenAPI document: valid OpenAPI 3, every route of the app in it, every request field in its
schema, and the /docs page built from it with nothing loaded from elsewhere."""

from __future__ import annotations

import re

import requests
from openapi_spec_validator import validate

from app import create_app
from schemas.config import Settings


def document(stack) -> dict:  # type: ignore[no-untyped-def]
    response = requests.get(f"{stack.base_url}/openapi.json", timeout=30)
    assert response.status_code == 200
    return response.json()


def test_the_document_is_valid_openapi_3(stack) -> None:
    spec = document(stack)
    validate(spec)
    assert spec["openapi"].startswith("3.")


def test_every_route_of_the_app_is_in_the_document(stack, settings: Settings) -> None:
    paths = document(stack)["paths"]
    app = create_app(settings)
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        assert path in paths, path
        documented = {m.upper() for m in paths[path]}
        assert (rule.methods or set()) - {"HEAD", "OPTIONS"} <= documented, path


def test_every_request_field_and_error_code_is_documented(stack, settings: Settings) -> None:
    spec = document(stack)
    service = create_app(settings).extensions["tokenline"]
    for name, schema in (
        ("ChatCompletionRequest", service.chat_schema),
        ("CompletionRequest", service.completion_schema),
        ("GenerateRequest", service.generate_schema),
    ):
        documented = spec["components"]["schemas"][name]["properties"]
        assert set(documented) == {f.data_key or n for n, f in schema.fields.items()}, name
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "415", "429", "500", "502", "503", "504"} <= set(chat)
    assert "text/event-stream" in chat["200"]["content"]


def test_the_docs_page_lists_every_route_and_loads_nothing_from_elsewhere(stack) -> None:
    response = requests.get(f"{stack.base_url}/docs", timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/html")
    page = response.text
    for path in document(stack)["paths"]:
        assert f"<code>{path}</code>" in page
    assert not re.search(r"<(script|link|img)\b", page)
    assert "temperature" in page and "maximum 2.0" in page


def test_the_fields_real_clients_send_are_documented_with_their_rules(stack) -> None:
    schemas = document(stack)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["store"]["enum"] == [False, None]
    assert chat["service_tier"]["enum"] == ["auto", "default", None]
    assert chat["modalities"]["items"]["enum"] == ["text"]
    assert (chat["metadata"]["maxProperties"], chat["metadata"]["additionalProperties"]["maxLength"]) == (16, 512)
    assert chat["reasoning_effort"]["enum"] == ["none", "minimal", "low", "medium", "high", None]
    options = schemas["StreamOptions"]["properties"]
    assert set(options) == {"include_usage", "continuous_usage_stats", "include_obfuscation"}
    assert options["include_obfuscation"]["enum"] == [False]
    # OpenAI's fields that are refused but for null (or the value that asks for what happens anyway).
    assert chat["verbosity"]["enum"] == ["medium"] and chat["verbosity"]["nullable"]
    assert chat["audio"]["description"] == "not supported: audio output" and "enum" not in chat["audio"]


def test_the_agents_apis_are_documented_field_by_field(stack, settings: Settings) -> None:
    spec = document(stack)
    extensions = create_app(settings).extensions
    for name, schema in (
        ("ResponsesRequest", extensions["tokenline.responses"].schema),
        ("MessagesRequest", extensions["tokenline.messages"].schema),
        ("CountTokensRequest", extensions["tokenline.messages"].count_schema),
    ):
        documented = spec["components"]["schemas"][name]["properties"]
        assert set(documented) == {f.data_key or n for n, f in schema.fields.items()}, name
    messages = spec["paths"]["/v1/messages"]["post"]["responses"]
    assert messages["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    assert "text/event-stream" in spec["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
