"""The router's OpenAPI spec (``/openapi.json``): what FastAPI cannot infer from handlers that parse their own
bodies (the generation requests, their headers and the resume link; the passed-through endpoints), and the
API-key security of a router that takes keys."""

from __future__ import annotations

from typing import Any

from fleetward.migration.adapters import ADAPTER_ROUTES
from fleetward.migration.journal import Kind, request_schema
from fleetward.migration.passthrough import ROUTES, Route

__all__ = ["keyed_spec", "openapi_adapters", "openapi_passthrough", "openapi_post", "operation_id"]


def operation_id(route: Route) -> str:
    name = route.path.strip("/").replace("/", "_").replace("{", "").replace("}", "")
    return f"{route.method.lower()}_{name}"


def openapi_passthrough(route: Route) -> dict[str, Any]:
    """What the spec says of a passed-through operation: the worker answers for its body."""
    extra: dict[str, Any] = {
        "description": f"Passed through to a healthy worker of the request's model (vLLM's `{route.path}`); the "
                       "worker's answer is the router's.",
        "responses": {"200": {"description": "the worker's answer"},
                      "400": {"description": "a request the worker refused, or no model where the fleet serves "
                                             "several"},
                      "404": {"description": "an unknown model"},
                      "503": {"description": "no healthy worker could answer"}},
    }
    if route.method == "POST" and route.model == "form":
        extra["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": {
            "type": "object", "properties": {"model": {"type": "string"}, "file": {"type": "string",
                                                                                   "format": "binary"}}}}}}
    elif route.method == "POST":
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"model": {"type": "string", "minLength": 1}},
            "additionalProperties": True}}}}
    return extra


def openapi_adapters(path: str) -> dict[str, Any]:
    """What the spec says of loading or unloading a LoRA adapter on the fleet (:mod:`.adapters`)."""
    props: dict[str, Any] = {"lora_name": {"type": "string", "minLength": 1}}
    if path.endswith("/load_lora_adapter"):
        props["lora_path"] = {"type": "string", "minLength": 1}
    return {
        "description": f"vLLM's `{path}`, on every routable worker: the first worker's success, else the first "
                       "worker's refusal. Requests name the adapter as their model.",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": list(props), "properties": props, "additionalProperties": True}}}},
        "responses": {"200": {"description": "done on at least one worker"},
                      "400": {"description": "the workers refused it (their words)"},
                      "404": {"description": "no worker has the adapter (unload)"},
                      "503": {"description": "no healthy worker"}},
    }


def openapi_post(kind: Kind) -> dict[str, Any]:
    """What the OpenAPI spec says of a generation request the handler parses itself: body, headers, the resume.

    The link says a 200's ``X-Request-Id`` resumes the request: the same body with ``Last-Event-ID``.
    """
    operation = "completions" if kind is Kind.COMPLETION else "chat_completions"
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema(kind)}}},
        "parameters": [
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "description": "resume a request: <request id>:<tokens the client holds>",
             "schema": {"type": "string", "pattern": "^[^:]+:[0-9]+$"}},
            {"name": "X-Fleetward-Event-Ids", "in": "header", "required": False,
             "description": "1: every SSE event carries id: <request id>:<tokens the client holds>",
             "schema": {"type": "string", "enum": ["1"]}},
            {"name": "X-Fleetward-Trace", "in": "header", "required": False,
             "description": "1: every chunk says which worker made it", "schema": {"type": "string", "enum": ["1"]}},
        ],
        "responses": {
            "200": {"description": "the completion, or its server-sent events with `stream`",
                    "headers": {"X-Request-Id": {"schema": {"type": "string"}}},
                    "links": {"Resume": {"operationId": operation, "requestBody": "$request.body",
                                         "parameters": {"header.Last-Event-ID": "{$response.header.X-Request-Id}:0"}}}},
            "400": {"description": "a malformed request, the parameter named"},
            "404": {"description": "an unknown model, or a resume of an unknown request"},
            "409": {"description": "a resume of a request that cannot be continued exactly (it is left alone)"},
            "503": {"description": "no worker can take it now, or the router is starting or stopping"},
        },
    }


def keyed_spec(spec: dict[str, Any]) -> None:
    """Amend ``spec`` for a router that takes API keys: which operations take one, and what a key adds."""
    spec.setdefault("components", {})["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    keyed_routes = [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                    *((r.path, r.method.lower()) for r in ROUTES), *((path, "post") for path in ADAPTER_ROUTES)]
    for path, method in keyed_routes:
        operation = spec["paths"][path][method]
        operation["security"] = [{"apiKey": []}]
        operation["responses"]["401"] = {"description": "a missing or unknown API key"}
        operation["responses"]["429"] = {"description": "the key has max_concurrency requests in flight"}
        if path in ("/v1/completions", "/v1/chat/completions"):
            operation["responses"]["404"]["description"] += " (or another key's request)"
