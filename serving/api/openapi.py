"""The API's OpenAPI description as a client generator or a fuzzer reads it: every ``$ref`` resolves inside the
document (pydantic's ``$defs`` of the request models written inline are moved to ``components/schemas``), every
refusal is described with the body it has (``ErrorBody``, or the Open Inference Protocol's ``OipError``), and a
server describes only the routes it answers (``/predict`` and ``/`` only with a default task)."""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from .oip_http import InferenceRequest, OipError

_DEFAULT_TASK_PATHS = ("/predict", "/")
_REFS = "#/components/schemas/"


class ErrorDetail(BaseModel):
    type: str = Field(description="machine-readable, also the metric label (see the Errors reference)")
    message: str = Field(description="what is wrong, naming the field and the value")


class ErrorBody(BaseModel):
    """Every refusal of fusionserve's own routes."""

    error: ErrorDetail


def _schemas(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema and the models it uses, by name, with references into ``components/schemas``."""
    schema = model.model_json_schema(ref_template=_REFS + "{model}")
    found = schema.pop("$defs", {})
    return found | {model.__name__: schema}


def _hoist(node: Any, into: dict[str, Any]) -> Any:
    """``node`` with every nested ``$defs`` moved into ``into`` and the references to them rewritten."""
    if isinstance(node, dict):
        for name, spec in (node.pop("$defs", None) or {}).items():
            into.setdefault(name, _hoist(spec, into))
        return {
            k: (_REFS + v.removeprefix("#/$defs/") if k == "$ref" and str(v).startswith("#/$defs/") else _hoist(v, into))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_hoist(v, into) for v in node]
    return node


def _error_content(oip: bool) -> dict[str, Any]:
    name = "OipError" if oip else "ErrorBody"
    return {"application/json": {"schema": {"$ref": _REFS + name}}}


def _describe_errors(paths: dict[str, Any]) -> None:
    """Every 4xx/5xx of every operation gets its body; FastAPI's own 422 (a validation error body fusionserve never
    sends) becomes fusionserve's, or goes (the Open Inference Protocol answers a bad request with 400)."""
    for path, ops in paths.items():
        oip = path.startswith("/v2")
        for op in ops.values():
            responses = op.get("responses", {})
            if "422" in responses and "HTTPValidationError" in str(responses["422"]):
                if oip:
                    del responses["422"]
                else:
                    responses["422"] = {"description": "bad request body or parameter"}
            for status, response in responses.items():
                if status[:1] in ("4", "5"):
                    response["content"] = _error_content(oip)


def describe(app: FastAPI, default_task: bool = True) -> dict[str, Any]:
    """The description of ``app``; without ``default_task`` the routes that need one are left out."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema = copy.deepcopy(schema)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    schema["paths"] = _hoist(schema["paths"], components)
    for model in (ErrorBody, OipError, InferenceRequest):
        for name, spec in _schemas(model).items():
            components.setdefault(name, spec)
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    if not default_task:
        for path in _DEFAULT_TASK_PATHS:
            schema["paths"].pop(path, None)
    _describe_errors(schema["paths"])
    return schema
