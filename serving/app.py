"""The HTTP ingress: FastAPI routes, request validation and the one place where errors become status codes.

Bad input is refused here, before the model: 422 for a malformed body or bad fields, 404 for an unknown task,
413 for a body or request over the limits (or a text over the token limit in strict mode), 503 when the model's
queues are full. Nothing the caller sends can produce a 500.
"""

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError

from fusionserve import __version__

from .artifact import load_artifact
from .metrics import Metrics
from .predictions import softmax
from .tokenize import Encoder

Text = Annotated[str, StringConstraints(strict=True, min_length=1, pattern=r"\S")]


class PairInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text
    text_pair: Text | None = Field(None, description="second text of a pair, encoded as [CLS] text [SEP] text_pair [SEP]")


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str = Field(description="a task of the served artifact (GET /v1/tasks)")
    inputs: list[Text | PairInput] = Field(min_length=1, description="plain texts and/or {text, text_pair} objects")
    return_fusion_activations: bool = Field(
        False, description="add per input the fusion weights per layer and adapter, averaged over its tokens"
    )
    strict: bool = Field(False, description="refuse (413) an input over the token limit instead of truncating it")


class Prediction(BaseModel):
    label: str
    score: float
    scores: dict[str, float]
    truncated: bool = Field(False, description="the input was cut to the token limit")


class FusionActivations(BaseModel):
    adapters: list[str]
    values: list[list[list[float]]] = Field(description="per input, per layer, per adapter (in 'adapters' order)")


class ClassifyResponse(BaseModel):
    task: str
    predictions: list[Prediction]
    fusion_activations: FusionActivations | None = None


@dataclass(frozen=True)
class Limits:
    max_inputs: int = 64
    max_body_bytes: int = 1_000_000


class HTTPError(Exception):
    def __init__(self, status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.headers = status, reason, message, headers or {}


app = FastAPI(
    title="fusionserve",
    version=__version__,
    description="AdapterFusion classification over one ONNX graph. Every task of the artifact behind one endpoint.",
)


def _describe(exc: ValidationError) -> str:
    """One line per bad field; an input that is neither a text nor a pair object is named once, not per union arm."""
    problems: dict[str, str] = {}
    for e in exc.errors():
        loc = e["loc"]
        if len(loc) >= 2 and loc[0] == "inputs" and isinstance(loc[1], int):
            item = e.get("input")
            where = f"inputs[{loc[1]}]"
            problems.setdefault(
                where, f'{where}: must be a non-empty string or an object {{"text": ..., "text_pair": ...}}, got {item!r:.60}'
            )
        else:
            where = ".".join(str(p) for p in loc) or "body"
            problems.setdefault(where, f"{where}: {e['msg'].lower()}")
    return "; ".join(list(problems.values())[:5])


@serve.deployment(name="ingress", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(self, model: Any, artifact_dir: str, limits: Limits) -> None:
        self.model = model
        self.artifact = load_artifact(artifact_dir, verify=False)  # the replicas verified it
        self.encoder = Encoder.from_file(self.artifact.tokenizer_path, self.artifact.max_seq_len, self.artifact.pad_token)
        self.limits = limits
        self.metrics = Metrics()
        self._ready_at = 0.0

    # --- routes ---------------------------------------------------------------------------------------------

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse,
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": ClassifyRequest.model_json_schema()}}}
        },
        responses={
            404: {"description": "unknown task"},
            413: {"description": "too large"},
            422: {"description": "bad request body"},
            503: {"description": "overloaded"},
        },
    )
    async def classify(self, request: Request) -> Response:
        """Classify texts (or text pairs) for one task."""
        started = time.perf_counter()
        task = "-"
        try:
            body = await self._read_body(request)
            req = self._parse(body)
            entry = self._task(req.task)
            task = req.task  # only known task names become metric labels
            inputs = [(i, None) if isinstance(i, str) else (i.text, i.text_pair) for i in req.inputs]
            if len(inputs) > self.limits.max_inputs:
                raise HTTPError(
                    413, "too_many_inputs", f"{len(inputs)} inputs in one request; the limit is {self.limits.max_inputs}"
                )
            if req.strict:
                self._check_lengths(inputs)
            if req.return_fusion_activations and entry.kind != "fusion":
                raise HTTPError(
                    422, "no_fusion", f"task '{task}' has no fusion layer ({entry.kind} task); there are no fusion activations"
                )
            try:
                result = await self.model.classify.remote(task, inputs, req.return_fusion_activations)
            except BackPressureError:
                raise HTTPError(503, "overloaded", "the model's queues are full; retry shortly", {"Retry-After": "1"}) from None
            self.metrics.observe_result(task, result, entry.adapters)
            payload = self._answer(task, entry.labels, entry.adapters, result, req.return_fusion_activations)
            return self._done(task, 200, started, JSONResponse(payload))
        except HTTPError as err:
            self.metrics.rejected.labels(err.reason).inc()
            return self._done(
                task,
                err.status,
                started,
                JSONResponse({"error": {"type": err.reason, "message": err.message}}, err.status, err.headers),
            )

    @app.get("/v1/tasks")
    async def tasks(self) -> dict[str, Any]:
        """Served tasks with their labels and adapters, and the token limit."""
        return {
            "max_seq_len": self.artifact.max_seq_len,
            "max_inputs_per_request": self.limits.max_inputs,
            "tasks": {
                n: {"kind": t.kind, "labels": list(t.labels), "adapters": list(t.adapters)}
                for n, t in self.artifact.tasks.items()
            },
        }

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """The HTTP ingress is alive."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(self) -> Response:
        """The model is loaded and answers a real request (checked at most every 5 s)."""
        if time.monotonic() - self._ready_at > 5.0:
            task = next(iter(self.artifact.tasks))
            try:
                await self.model.classify.remote(task, [("ready", None)], False)
            except Exception as exc:  # any failure of the model path means not ready; say which
                return JSONResponse({"status": "not ready", "error": f"{type(exc).__name__}: {exc}"}, 503)
            self._ready_at = time.monotonic()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text format."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- helpers --------------------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, "body_too_large", f"request body of {declared} bytes; the limit is {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, "body_too_large", f"request body over {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, body: bytes) -> ClassifyRequest:
        try:
            json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(422, "malformed_json", f"the body is not valid JSON: {exc}") from None
        try:
            return ClassifyRequest.model_validate_json(body)
        except ValidationError as exc:
            raise HTTPError(422, "invalid_request", _describe(exc)) from None

    def _task(self, task: str) -> Any:
        if task not in self.artifact.tasks:
            raise HTTPError(404, "unknown_task", f"unknown task '{task}'; known tasks: {', '.join(self.artifact.tasks)}")
        return self.artifact.tasks[task]

    def _check_lengths(self, inputs: list[tuple[str, str | None]]) -> None:
        from .predictions import TextInput

        lengths = self.encoder.count_tokens([TextInput(t, p) for t, p in inputs])
        over = [(i, n) for i, n in enumerate(lengths) if n > self.artifact.max_seq_len]
        if over:
            where = ", ".join(f"inputs[{i}] has {n}" for i, n in over[:5])
            raise HTTPError(413, "too_many_tokens", f"{where} tokens; the limit is {self.artifact.max_seq_len} (strict mode)")

    def _answer(
        self, task: str, labels: tuple[str, ...], adapters: tuple[str, ...], result: Any, with_acts: bool
    ) -> dict[str, Any]:
        import numpy as np

        probs = softmax(np.asarray(result.logits, dtype=np.float64))
        preds = []
        for p, cut in zip(probs, result.truncated, strict=True):
            best = int(np.argmax(p))
            preds.append(
                {
                    "label": labels[best],
                    "score": round(float(p[best]), 6),
                    "scores": {lab: round(float(v), 6) for lab, v in zip(labels, p, strict=True)},
                    "truncated": bool(cut),
                }
            )
        out: dict[str, Any] = {"task": task, "predictions": preds}
        if with_acts and result.activations is not None:
            out["fusion_activations"] = {
                "adapters": list(adapters),
                "values": [[[round(v, 6) for v in row] for row in per] for per in result.activations],
            }
        return out

    def _done(self, task: str, status: int, started: float, response: Response) -> Response:
        self.metrics.request_duration.labels(task, str(status)).observe(time.perf_counter() - started)
        return response
