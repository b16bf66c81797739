"""The Ray Serve deployment: FastAPI routes in front of one ONNX Runtime session, in one replica process.

HTTP handling and the model share the replica, so a request crosses no Ray hop once it reaches the replica (with
the default HAProxy ingress, HAProxy hands the connection straight to a replica's own HTTP port). Bad input is
refused here, before the model: 422 for a malformed body or bad fields, 404 for an unknown task, 413 for a body or
request over the limits (or a text over the token limit in strict mode), 503 at once when the replica's queue is
full. Batching is ``batching.Scheduler``'s: no timer at low load, a token budget under load.
"""

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from fusionserve import __version__

from .artifact import TaskEntry, load_artifact
from .batching import BatchLimits, BatchStats, Overloaded, Scheduler, TaskResult
from .metrics import Metrics
from .predictions import TextInput, label_scores
from .runtime import OnnxRunner
from .schemas import (
    ClassifyRequest,
    ClassifyResponse,
    HTTPError,
    Limits,
    MultiTaskResponse,
    describe_json_error,
    describe_validation_error,
)

app = FastAPI(
    title="fusionserve",
    version=__version__,
    description="AdapterFusion classification over one ONNX graph. Every task of the artifact behind one endpoint.",
    docs_url=None,  # served below from the package's own Swagger UI files: the default loads them from a CDN
    redoc_url=None,
)
_JSON = "application/json"
_READY_EVERY_S = 5.0
_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed"}
_DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}
log = logging.getLogger("ray.serve").getChild("fusionserve")  # in the replica log files, with Serve's own


def _error(status: int, reason: str, message: str) -> Response:
    # after a body that never completed, the connection is out of step: close it rather than keep it alive
    headers = {"connection": "close"} if status == 408 else None
    return _json({"error": {"type": reason, "message": message}}, status, headers)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and methods get the same error shape as everything else."""
    return _error(
        exc.status_code, _HTTP_TYPES.get(exc.status_code, "http_error"), f"{request.method} {request.url.path}: {exc.detail}"
    )


@app.exception_handler(RequestValidationError)
async def _request_invalid(request: Request, exc: RequestValidationError) -> Response:
    return _error(422, "invalid_request", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> Response:
    """The boundary's catch-all: an error of ours is a JSON 500 with an id that is also in the server log."""
    return _error(500, "internal", _log_unexpected(f"{request.method} {request.url.path}", exc))


def _log_unexpected(where: str, exc: BaseException) -> str:
    error_id = uuid.uuid4().hex[:12]
    log.error("unexpected error %s in %s", error_id, where, exc_info=exc)
    return f"unexpected server error (id {error_id}, also in the server log); the request was not processed"


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status, headers, media_type=_JSON)


def _replica_id() -> str:
    """This replica's Serve id (sent back as ``x-fusionserve-replica``, so load spread over replicas is visible)."""
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (a test instantiating the class): the process id will do
        return str(os.getpid())


def _answer(task: str, entry: TaskEntry, result: TaskResult, truncated: list[bool], with_acts: bool) -> dict[str, Any]:
    preds = [
        {"label": label, "score": score, "scores": scores, "truncated": bool(cut)}
        for (label, score, scores), cut in zip(label_scores(entry.labels, result.logits), truncated, strict=True)
    ]
    out: dict[str, Any] = {"task": task, "predictions": preds}
    if with_acts and result.activations is not None:
        values = [[[round(v, 6) for v in row] for row in per] for per in result.activations.tolist()]
        out["fusion_activations"] = {"adapters": list(entry.adapters), "values": values}
    return out


@serve.ingress(app)
class FusionServe:
    """One replica: validation, continuous batching over every task's queue, one ONNX Runtime session, metrics."""

    def __init__(self, artifact_dir: str, limits: Limits, batch: BatchLimits, threads: int | None, device: str = "auto") -> None:
        self.artifact = load_artifact(artifact_dir)
        # no spinning: between runs the cores belong to the HTTP side. On CUDA the runner binds reused device
        # buffers and pads batches to bucket lengths (see serving/runtime.py).
        runner = OnnxRunner(self.artifact, threads=threads or len(os.sched_getaffinity(0)), spin=False, device=device)
        self.encoder = runner.encoder
        self.limits = limits
        self.stats = Metrics()
        self.scheduler = Scheduler(runner, batch, self._on_batch)
        self._ready_at = 0.0
        self._headers = {"x-fusionserve-replica": _replica_id()}

    def _on_batch(self, batch: BatchStats) -> None:
        self.stats.observe_batch(batch, lambda task: self.artifact.tasks[task].adapters)

    # --- routes ---------------------------------------------------------------------------------------------

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse | MultiTaskResponse,
        openapi_extra={"requestBody": {"required": True, "content": {_JSON: {"schema": ClassifyRequest.model_json_schema()}}}},
        responses={
            404: {"description": "unknown task"},
            413: {"description": "too large"},
            422: {"description": "bad request body"},
            503: {"description": "overloaded: the replica's queue is full; retry later"},
        },
    )
    async def classify(self, request: Request) -> Response:
        """Classify texts (or text pairs) for one task, or for several ("tasks") in one call."""
        started = time.perf_counter()
        task = "-"  # only known task names become metric labels
        try:
            req = self._parse(await self._read_body(request))
            entries = self._tasks(req.task_names)
            task = req.task_names[0] if req.task is not None else "multi"
            inputs = tuple(TextInput(i) if isinstance(i, str) else TextInput(i.text, i.text_pair) for i in req.inputs)
            self._check(req, inputs, entries)
            try:
                result = await self.scheduler.submit(req.task_names, inputs)
            except Overloaded as exc:
                raise HTTPError(503, "overloaded", f"the replica's queue is full: {exc}; retry later") from None
            answers = [_answer(e.name, e, result.tasks[e.name], result.truncated, req.return_fusion_activations) for e in entries]
            response = _json(answers[0] if req.task is not None else {"results": answers}, headers=self._headers)
            self.stats.observe_request(task, 200, time.perf_counter() - started, result.queue_ms)
            return response
        except HTTPError as err:
            self.stats.observe_rejected(err.reason)
            self.stats.observe_request(task, err.status, time.perf_counter() - started)
            return _error(err.status, err.reason, err.message)
        except Exception as exc:  # a bug or a runtime failure: never a bare 500, always an id to find it in the log
            self.stats.observe_request(task, 500, time.perf_counter() - started)
            return _error(500, "internal", _log_unexpected("POST /v1/classify", exc))

    @app.get("/v1/tasks")
    async def tasks(self) -> dict[str, Any]:
        """Served tasks with their labels and adapters, and the limits."""
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
        """The replica is alive."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(self) -> Response:
        """The model answers a real request (checked at most every 5 s)."""
        if time.monotonic() - self._ready_at > _READY_EVERY_S:
            task = next(iter(self.artifact.tasks))
            try:
                await self.scheduler.submit(task, (TextInput("ready"),))
            except Exception as exc:  # any failure of the model path means not ready; say which
                return _json({"status": "not ready", "error": f"{type(exc).__name__}: {exc}"}, 503)
            self._ready_at = time.monotonic()
        return _json({"status": "ready"})

    @app.get("/docs", include_in_schema=False)
    async def docs(self) -> Response:
        """Swagger UI for the API, from files inside the installed package: works offline."""
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title="fusionserve API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js", swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
        )  # fmt: skip

    @app.get("/docs-assets/{name}", include_in_schema=False)
    async def docs_asset(self, name: str) -> Response:
        if name not in _DOCS_ASSETS:
            return _error(404, "not_found", f"GET /docs-assets/{name}: no such file")
        from swagger_ui_bundle import swagger_ui_path

        return Response((swagger_ui_path / name).read_bytes(), media_type=_DOCS_ASSETS[name])

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Prometheus text format (all replicas on this node, see serving/metrics.py)."""
        body, content_type = self.stats.render()
        return Response(body, media_type=content_type)

    # --- helpers --------------------------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, "body_too_large", f"request body of {declared} bytes; the limit is {limit}")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPError(413, "body_too_large", f"request body over {limit} bytes; the limit is {limit}")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise HTTPError(
                408,
                "body_timeout",
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s (Content-Length {declared})",
            ) from None

    def _parse(self, body: bytes) -> ClassifyRequest:
        """The body, parsed and validated in one pass; a body that is not JSON is ``malformed_json``."""
        try:
            return ClassifyRequest.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors()
            if errors and errors[0]["type"] == "json_invalid":
                raise HTTPError(422, "malformed_json", describe_json_error(errors[0]["msg"])) from None
            raise HTTPError(422, "invalid_request", describe_validation_error(exc)) from None

    def _tasks(self, names: list[str]) -> list[TaskEntry]:
        unknown = [t for t in names if t not in self.artifact.tasks]
        if unknown:
            what = f"unknown task '{unknown[0]}'" if len(unknown) == 1 else f"unknown tasks {', '.join(map(repr, unknown))}"
            raise HTTPError(404, "unknown_task", f"{what}; known tasks: {', '.join(self.artifact.tasks)}")
        return [self.artifact.tasks[t] for t in names]

    def _check(self, req: ClassifyRequest, inputs: tuple[TextInput, ...], entries: list[TaskEntry]) -> None:
        """The limits and what the tasks allow, before anything is queued."""
        rows, limit = len(inputs) * len(entries), self.limits.max_inputs
        if rows > limit:
            what = f"{len(inputs)} inputs" if len(entries) == 1 else f"{len(inputs)} inputs x {len(entries)} tasks = {rows}"
            raise HTTPError(413, "too_many_inputs", f"{what} in one request; the limit is {limit}")
        if req.strict:
            self._check_lengths(inputs)
        plain = [e for e in entries if e.kind != "fusion"]
        if req.return_fusion_activations and plain:
            raise HTTPError(
                422,
                "no_fusion",
                f"task '{plain[0].name}' has no fusion layer ({plain[0].kind} task); there are no fusion activations",
            )

    def _check_lengths(self, inputs: tuple[TextInput, ...]) -> None:
        lengths = self.encoder.count_tokens(inputs)
        over = [(i, n) for i, n in enumerate(lengths) if n > self.artifact.max_seq_len]
        if over:
            where = ", ".join(f"inputs[{i}] has {n}" for i, n in over[:5])
            raise HTTPError(413, "too_many_tokens", f"{where} tokens; the limit is {self.artifact.max_seq_len} (strict mode)")


def deployment(replicas: int, threads: int, max_ongoing: int, max_queued: int, gpus: float = 0.0) -> Any:
    """FusionServe as a Serve deployment: ``replicas`` replicas reserving ``threads`` CPUs (and ``gpus`` GPUs,
    a fraction when replicas share one) each. Serve hands a replica at most ``max_ongoing`` requests at once and
    keeps up to ``max_queued`` more waiting; the replica's own queue (``BatchLimits.max_queued``) refuses first."""
    return serve.deployment(
        FusionServe,
        name="fusionserve",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        max_queued_requests=max_queued,
        ray_actor_options=actor_options(threads, gpus),
    )


def actor_options(threads: int, gpus: float) -> dict[str, Any]:
    """Ray resources of one replica; a GPU is asked for only when it runs on one (Ray then sets its
    CUDA_VISIBLE_DEVICES to the GPU it was given)."""
    return {"num_cpus": threads, "num_gpus": gpus} if gpus > 0 else {"num_cpus": threads}
