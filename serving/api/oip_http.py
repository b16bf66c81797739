"""The Open Inference Protocol's REST routes (``/v2/...``), with Triton's binary tensor data extension: a body may be a
JSON header (``Inference-Header-Content-Length`` bytes) followed by the inputs' raw data (each input's
``parameters.binary_data_size`` bytes, in order), and an answer carries its outputs so when asked (an output's
``binary_data``, or the request's ``binary_data_output``). What a request means, and the answer's tensors, are
``oip.py``'s; the call goes through the replica's ``Classifier`` like every other. A refusal is the protocol's
``{"error": "..."}`` with the HTTP status (a bad request: 400), and the error type in ``x-fusionserve-error-type``.

``POST .../infer`` is served from the ASGI scope (``OipFastPath``, as POST /v1/classify is) past FastAPI's routing;
the routes below define the API (OpenAPI, /docs) and answer exactly the same.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from . import oip
from .bodies import BINARY, JSON, read_body
from .schemas import TIMEOUT_HEADER, HTTPError

HEADER_LENGTH = "inference-header-content-length"
ERROR_TYPE_HEADER = "x-fusionserve-error-type"
_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
_replica: Any = None  # this process's replica (serving/api/app.py attaches it): what the routes answer from


def is_oip_path(path: str) -> bool:
    """Whether ``path`` is one of this protocol's (its refusals then have the protocol's shape)."""
    return path == "/v2" or path.startswith(("/v2/models/", "/v2/health/")) or path in ("/v2/models", "/v2/health")


def attach(replica: Any) -> None:
    """Make ``replica`` what the routes and the fast path answer from (see app.py's ``_serve_with``)."""
    global _replica
    _replica = replica


def http_status(status: int) -> int:
    """The status the protocol answers a refusal of ``status`` with: 400 for a request the checks refuse (422)."""
    return 400 if status == 422 else status


def error(status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> Response:
    """The protocol's error body; a body that did not arrive whole closes the connection (as app.py's errors)."""
    extra = {ERROR_TYPE_HEADER: reason} | ({"connection": "close"} if status == 408 else {}) | (headers or {})
    return Response(orjson.dumps({"error": message}), http_status(status), extra, media_type=JSON)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type=JSON)


# --- the request, and the answer, in their HTTP form ------------------------------------------------------------


def _tensor(item: Any, where: str, blob: memoryview, at: int) -> tuple[oip.Tensor, int]:
    """One input of the JSON header, its data from ``data`` or from ``blob`` at ``at`` (the binary extension)."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("datatype"), str):
        raise oip.bad(f"{where}: an input is an object with 'name', 'datatype', 'shape' and 'data', got {str(item)[:60]!r}")
    shape, params = item.get("shape"), item.get("parameters") or {}
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise oip.bad(f"input '{item['name']:.60}': 'shape' must be a list of whole numbers >= 0, got {str(shape)[:40]}")
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is None:
        data = item.get("data")
        if not isinstance(data, list):
            raise oip.bad(f"input '{item['name']:.60}': no 'data' and no parameters.binary_data_size")
        while data and all(isinstance(d, list) for d in data):  # nested rows: flattened, row-major
            data = [e for row in data for e in row]
        if item["datatype"] == "BYTES" and not all(isinstance(e, str) for e in data):
            raise oip.bad(f"input '{item['name']:.60}': BYTES data are strings, got {str(data)[:60]}")
        return oip.Tensor(item["name"], item["datatype"], tuple(shape), data), at
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or at + size > len(blob):
        raise oip.bad(
            f"input '{item['name']:.60}': binary_data_size {size!r:.20} but {len(blob) - at} byte(s) of binary data are "
            "left after the JSON header (Inference-Header-Content-Length)"
        )
    raw = bytes(blob[at : at + size])
    data = oip.bytes_elements(raw, f"input '{item['name']}'") if item["datatype"] == "BYTES" else [raw]
    return oip.Tensor(item["name"], item["datatype"], tuple(shape), data), at + size


def read_infer(body: bytes, header_length: str | None, model: str, version: str) -> oip.InferCall:
    """An inference request as it arrives over HTTP. Raises HTTPError 400 naming what is wrong."""
    if header_length is None:
        head, blob = body, memoryview(b"")
    elif header_length.isdigit() and int(header_length) <= len(body):
        head, blob = body[: int(header_length)], memoryview(body)[int(header_length) :]
    else:
        raise oip.bad(
            f"Inference-Header-Content-Length: {header_length!r:.20} is not a length within the body's {len(body)} bytes"
        )
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as exc:
        raise oip.bad(f"the request (JSON header) is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise oip.bad('the request must be an object with "inputs" (a list of tensors)')
    unknown = sorted(set(doc) - {"id", "parameters", "inputs", "outputs"})
    params, outputs = doc.get("parameters") or {}, doc.get("outputs") or []
    if unknown or not isinstance(params, dict) or not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise oip.bad(
            f"the request holds id, parameters (an object), inputs and outputs (a list of objects); got {unknown or doc}"[:300]
        )
    tensors, at = [], 0
    for i, item in enumerate(doc["inputs"]):
        tensor, at = _tensor(item, f"inputs[{i}]", blob, at)
        tensors.append(tensor)
    if at != len(blob):
        raise oip.bad(f"{len(blob) - at} byte(s) of binary data after the JSON header belong to no input (binary_data_size)")
    inputs, rank = oip.read_inputs(tensors)
    binary = params.get("binary_data_output", False)
    if not isinstance(binary, bool):
        raise oip.bad(f"parameter 'binary_data_output' must be true or false, got {binary!r:.40}")
    call = oip.InferCall(model, version, str(doc.get("id", ""))[:256], oip.request_fields(model, inputs, params), rank)
    call.outputs, call.binary_output = oip.read_outputs(outputs), binary
    return call


def answer(call: oip.InferCall, version: str, tensors: list[oip.OutTensor]) -> Response:
    """The inference response: JSON, or a JSON header and the binary outputs after it."""
    head: dict[str, Any] = {"model_name": call.model, "model_version": version}
    if call.id:
        head["id"] = call.id
    outputs, blobs = [], []
    for ask, t in zip(call.outputs, tensors, strict=True):
        out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if ask.binary if ask.binary is not None else call.binary_output:
            raw = t.raw()
            out["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            out["data"] = t.json_data()
        outputs.append(out)
    head["outputs"] = outputs
    text = orjson.dumps(head, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return Response(text, 200, media_type=JSON)
    return Response(b"".join([text, *blobs]), 200, {HEADER_LENGTH: str(len(text))}, media_type=BINARY)


async def infer(replica: Any, request: Request, model: str, version: str) -> Response:
    """POST /v2/models/{model}[/versions/{version}]/infer through the replica's Classifier."""
    core, held = replica.core, {}

    async def read() -> Any:
        body = await read_body(request, core.limits, binary=True)
        held["call"] = call = read_infer(body, request.headers.get(HEADER_LENGTH), model, version)
        return oip.classify_request(call, core.artifact)

    def check(served: Any) -> None:
        held["version"] = oip.version_of(served)
        oip.check_version(model, version, served)

    outcome = await core(
        read, f"POST /v2/models/{model}/infer", request.headers.get(TIMEOUT_HEADER), check=check,
        traceparent=request.headers.get("traceparent"), answered_as=http_status,
    )  # fmt: skip
    if isinstance(outcome, HTTPError):
        return error(outcome.status, outcome.reason, outcome.message)
    return answer(held["call"], held["version"], oip.output_tensors(held["call"], outcome))


class OipFastPath:
    """POST .../infer from the ASGI scope straight to ``infer`` (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        found = _INFER.match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if _replica is None or found is None:
            await self.app(scope, receive, send)
            return
        response = await infer(_replica, Request(scope, receive), found.group(1), found.group(2) or "")
        await response(scope, receive, send)


# --- the routes ----------------------------------------------------------------------------------------------------


class OipError(BaseModel):
    error: str = Field(description="what is wrong (the error type is in the x-fusionserve-error-type header)")


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1: any size")
    parameters: dict[str, Any] | None = None


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] = Field(description="the revision served (a live artifact), else '1'")
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] = Field(description="labels: the columns of 'scores'; kind; adapters")


class RequestInput(BaseModel):
    name: str = Field(description="text, or text_pair")
    datatype: str = Field(description="BYTES")
    shape: list[int] = Field(description="[n] or [n, 1]")
    parameters: dict[str, Any] | None = Field(None, description="binary_data_size: the input's bytes after the JSON header")
    data: list[Any] | None = Field(None, description="the texts (absent with binary_data_size)")


class RequestOutput(BaseModel):
    name: str = Field(description="label, or scores")
    parameters: dict[str, Any] | None = Field(None, description="binary_data (bool); classification (top k, on scores)")


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="raw_scores, strict, truncation_direction (as /v1/classify), timeout (us), binary_data_output"
    )
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = Field(None, description="default: label and scores")


class ResponseOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[ResponseOutput]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    what = {400: "a bad request", 401: "no or a wrong API key", 404: "unknown model or version", 408: "the body came too slowly",
            413: "the body or the request is over the limits", 415: "not JSON or binary, or compressed",
            503: "not ready, or overloaded (retry)", 504: "dropped at its deadline"}  # fmt: skip
    return {s: {"model": OipError, "description": what[s]} for s in statuses}


router = APIRouter(tags=["Open Inference Protocol"])
_MODEL_ERRORS = _errors(401, 404) | {
    400: {"model": OipError, "description": "a task whose head this protocol does not serve (POST /v1/classify does)"}
}
# the binary tensor data extension's body (the JSON header, then the inputs' bytes, as application/octet-stream or with
# no Content-Type) is not described: no schema can say where its JSON ends (the Inference-Header-Content-Length header)
_INFER_BODY = {JSON: {"schema": {"$ref": "#/components/schemas/InferenceRequest"}}}


@router.get("/v2", response_model=ServerMetadata, responses=_errors(401))
async def server_metadata() -> Response:
    """The server's name, version and protocol extensions."""
    return _json(oip.server_metadata())


@router.get("/v2/health/live", responses=_errors(503))
async def server_live() -> Response:
    """The server is live (no key asked)."""
    return _json({"live": True})


@router.get("/v2/health/ready", responses=_errors(503))
async def server_ready() -> Response:
    """The server is ready: the model answers a real request (checked at most every 5 s; no key asked)."""
    problem = await _replica.ready_problem()
    return _json({"ready": True}) if problem is None else error(503, "not_ready", problem)


def _model(model: str, version: str) -> Any:
    return oip.model_entry(_replica.runner.served, model, version)


async def _metadata(model: str, version: str = "") -> Response:
    try:
        return _json(oip.model_metadata(_replica.runner.served, _model(model, version)))
    except HTTPError as exc:
        return error(exc.status, exc.reason, exc.message)


async def _ready(model: str, version: str = "") -> Response:
    try:
        return _json({"name": _model(model, version).name, "ready": True})
    except HTTPError as exc:
        return error(exc.status, exc.reason, exc.message)


async def _config(model: str, version: str = "") -> Response:
    try:
        entry = _model(model, version)
    except HTTPError as exc:
        return error(exc.status, exc.reason, exc.message)
    limits, batch = _replica.limits, _replica.scheduler.limits
    return _json(oip.model_config(entry, limits.max_inputs, batch.batch_wait_ms, _replica.runner.device))


async def _infer(request: Request, model: str, version: str = "") -> Response:
    return await infer(_replica, request, model, version)


for _prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
    router.add_api_route(_prefix, _metadata, methods=["GET"], response_model=ModelMetadata, responses=_MODEL_ERRORS,
                         summary="A model's versions, inputs and outputs (the task's labels in parameters.labels)")  # fmt: skip
    router.add_api_route(f"{_prefix}/ready", _ready, methods=["GET"], responses=_MODEL_ERRORS, summary="The model is ready")
    router.add_api_route(f"{_prefix}/config", _config, methods=["GET"], responses=_MODEL_ERRORS,
                         summary="Triton's model configuration (as its clients and perf_analyzer read it)")  # fmt: skip
    router.add_api_route(
        f"{_prefix}/infer", _infer, methods=["POST"], response_model=InferenceResponse,
        responses={200: {"content": {BINARY: {"schema": {"type": "string", "format": "binary"}}}}} | _errors(400, 401, 404, 408, 413, 415, 503, 504),
        openapi_extra={"requestBody": {"required": True, "content": _INFER_BODY}},
        summary="Classify texts (or pairs) with the model: label and scores, or the top k (classification)",
    )  # fmt: skip
