"""The Ray Serve deployment: FastAPI routes in front of one ONNX Runtime session, in one replica process.

HTTP handling and the model share the replica, so a request crosses no Ray hop once it reaches the replica (with
the default HAProxy ingress, HAProxy hands the connection straight to a replica's own HTTP port). Bad input is
refused here, before the model: 422 for a malformed body or bad fields, 404 for an unknown task, 413 for a body or
request over the limits (or a text over the token limit in strict mode), 503 at once when the replica's queue is
full. Batching is ``batching.Scheduler``'s: no timer at low load, a token budget under load.
"""

import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from fusionserve import __version__

from ..model import revisions
from ..model.artifact import MANIFEST, ArtifactError, load_artifact, sha256
from ..model.heads import head, probe
from ..model.runtime import OnnxRunner
from ..options import bounded
from ..scheduler.batching import BatchLimits, BatchStats, Scheduler
from . import oip_http, tracing
from .asgi import HeadAsGet
from .auth import CHALLENGE, UNAUTHORIZED, KeyCheck, header, is_open
from .bodies import read_body
from .classify import Classifier, describe_tasks, log, log_unexpected, parse_json
from .grpc_ingress import classify_grpc, record_call_deadlines
from .metrics import METRICS_ENV, Metrics
from .oip_grpc import OipGrpc
from .openapi import describe
from .schemas import JSON as _JSON
from .schemas import TIMEOUT_HEADER, ClassifyRequest, ClassifyResponse, HTTPError, Limits, MultiTaskResponse
from .tei import check_default_task, predictions, read_request, unsupported

app = FastAPI(
    title="fusionserve",
    version=__version__,
    description="AdapterFusion classification over one ONNX graph. Every task of the artifact behind one endpoint.",
    docs_url=None,  # served below from the package's own Swagger UI files: the default loads them from a CDN
    redoc_url=None,
)
# no 307 to the path without its trailing slash: Starlette builds that redirect from the request's Host header
app.router.redirect_slashes = False
_READY_EVERY_S = 5.0
_REVISION_POLL_S = 0.25  # how often a replica of a live artifact stats its revision pointer
_replica: "FusionServe | None" = None  # this process's replica (Serve runs one per process): the fast path's target


class _ClassifyFastPath:
    """POST /v1/classify from the ASGI scope straight to the replica's handler, past FastAPI's routing and endpoint
    machinery (about 0.2 ms a request on these cores, measured on a trivial route: see benchmarks/RESULTS.md). The
    route below stays the API's definition (OpenAPI, /docs) and answers exactly the same, so whichever path a
    request takes, its answer does not change."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        replica = _replica
        if replica is None or scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/classify":
            await self.app(scope, receive, send)
            return
        response = await replica.classify(Request(scope, receive))
        await response(scope, receive, send)


def _refusal(path: str, status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> Response:
    """A refusal in the shape of the route's protocol: the Open Inference Protocol's under /v2, fusionserve's elsewhere."""
    if oip_http.is_oip_path(path):
        return oip_http.error(status, reason, message, headers)
    return _error(status, reason, message, headers)


class _KeyGuard:
    """With an API key set, every request outside the open paths (probes, docs, and /metrics unless closed) must
    carry it (serving/api/auth.py), whichever route, the fast path's included: refused here with 401 before anything
    else reads it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        replica = _replica
        if (
            replica is None
            or replica.keys is None
            or scope["type"] != "http"
            or is_open(scope["path"], replica.open_metrics)
            or replica.keys.allows(header(scope["headers"]))
        ):
            await self.app(scope, receive, send)
            return
        replica.stats.observe_rejected(UNAUTHORIZED.reason)
        replica.stats.observe_request("-", UNAUTHORIZED.status, 0.0)
        response = _refusal(scope["path"], UNAUTHORIZED.status, UNAUTHORIZED.reason, UNAUTHORIZED.message, CHALLENGE)
        await response(scope, receive, send)


app.add_middleware(_ClassifyFastPath)
app.add_middleware(oip_http.OipFastPath)
app.add_middleware(HeadAsGet)
app.add_middleware(_KeyGuard)  # in front of the fast path too


def _tracer() -> "tracing.Tracer | None":
    """This process's replica's tracer (a function of this module, not a lambda: Serve pickles the app with the class,
    a lambda by value, with a copy of the globals it reads, where ``_replica`` stays None)."""
    return _replica.core.tracer if _replica is not None else None


# the outermost: a trace's request starts as early as fusionserve's code sees it, and ends once its answer is sent
app.add_middleware(tracing.TraceEdge, tracer=_tracer)
_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed"}
_DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}


def _error(status: int, reason: str, message: str, extra: dict[str, str] | None = None) -> Response:
    # after a body that never completed, the connection is out of step: close it rather than keep it alive
    headers = ({"connection": "close"} if status == 408 else {}) | (extra or {})
    return _json({"error": {"type": reason, "message": bounded(message)}}, status, headers)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
    """Unknown paths and methods get the same error shape as everything else (a 405 with its Allow header)."""
    reason, path = _HTTP_TYPES.get(exc.status_code, "http_error"), request.url.path
    return _refusal(path, exc.status_code, reason, f"{request.method} {path}: {exc.detail}", dict(exc.headers or {}))


@app.exception_handler(RequestValidationError)
async def _request_invalid(request: Request, exc: RequestValidationError) -> Response:
    return _error(422, "invalid_request", "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> Response:
    """The boundary's catch-all: an error of ours is a JSON 500 with an id that is also in the server log."""
    return _error(500, "internal", log_unexpected(f"{request.method} {request.url.path}", exc))


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status, headers, media_type=_JSON)


def _openapi() -> dict[str, Any]:
    """The description a client generator reads (serving/api/openapi.py): a replica without a default task leaves out
    the routes that need one; outside a replica (the docs' reference) every route is described."""
    replica = _replica
    with_default = replica is None or replica.default_task is not None
    if app.openapi_schema is None or app.openapi_schema.get("x-default-task") != with_default:
        app.openapi_schema = describe(app, with_default) | {"x-default-task": with_default}
    return {k: v for k, v in app.openapi_schema.items() if k != "x-default-task"}


app.include_router(oip_http.router)
app.openapi = _openapi  # type: ignore[method-assign]


def _where() -> dict[str, str]:
    """This replica's Serve id and its Ray node (sent back as ``x-fusionserve-replica`` and ``x-fusionserve-node``, so
    load spread over replicas and nodes is visible)."""
    try:
        return {"replica": str(serve.get_replica_context().replica_id.unique_id), "node": ray.get_runtime_context().get_node_id()}
    except Exception:  # outside a Serve replica (a test instantiating the class): the process id will do
        return {"replica": str(os.getpid()), "node": "-"}


def _serve_with(replica: "FusionServe") -> None:
    """Make ``replica`` the middlewares' target. A function of this module, not ``global`` in ``__init__``: Serve ships
    the class by value (``serve.ingress`` rebinds its module name), so its methods write globals of a copy of this
    module's namespace, which the middlewares (shipped by reference) never see."""
    global _replica
    _replica = replica
    oip_http.attach(replica)


def _check_identity(folder: Path, expected: str | None) -> None:
    """The builder names the artifact every replica must serve (its manifest's sha256): a node whose copy differs
    (another model at the same path, a stale runtime-env copy) must not answer for it."""
    if expected is not None and sha256(folder / MANIFEST) != expected:
        raise ArtifactError(
            f"{folder.resolve()} on this node is not the artifact this application was built for (manifest sha256 "
            f"{sha256(folder / MANIFEST)[:12]}..., expected {expected[:12]}...): give every node the same artifact"
        )


@serve.ingress(app)
class FusionServe(OipGrpc):
    """One replica: validation, continuous batching over every task's queue, one ONNX Runtime session, metrics; the
    Open Inference Protocol's gRPC methods come from ``OipGrpc``."""

    def __init__(
        self, artifact_dir: str, limits: Limits, batch: BatchLimits, threads: int | None, device: str = "auto",
        artifact_sha256: str | None = None, api_key_env: str | None = None, open_metrics: bool = True,
        default_task: str | None = None, otlp_endpoint: str | None = None, trace_sample_ratio: float = 1.0,
        log_format: str = "text",
    ) -> None:  # fmt: skip
        record_call_deadlines()
        if log_format == "json":  # Serve writes this replica's log as JSON (the deployment's logging_config)
            tracing.log_json_with_trace_ids()
        artifact = load_artifact(artifact_dir)
        _check_identity(artifact.folder, artifact_sha256)
        # the keys from this process's own environment (never an argument: see serving/api/auth.py); none set: refused
        self.keys = KeyCheck.from_env(api_key_env) if api_key_env else None
        self.open_metrics = open_metrics
        check_default_task(artifact, default_task)
        self.default_task = default_task
        if os.environ.get(METRICS_ENV):  # each node's replicas pool their samples in their own copy
            os.makedirs(os.environ[METRICS_ENV], exist_ok=True)
        # no spinning: between runs the cores belong to the HTTP side. On CUDA the runner binds reused device
        # buffers and pads batches to bucket lengths (see serving/model/runtime.py).
        runner = OnnxRunner(artifact, threads=threads or len(os.sched_getaffinity(0)), spin=False, device=device)
        self.limits = limits
        self.stats = Metrics()
        self.scheduler = Scheduler(runner, batch, self._on_batch)
        self.where = _where()
        # None without an endpoint (nothing of OpenTelemetry imported); spans name this replica and its node
        tracer = tracing.tracer_from(otlp_endpoint, trace_sample_ratio, {f"fusionserve.{k}": v for k, v in self.where.items()})
        self.core = Classifier(runner.encoder, self.scheduler, limits, self.stats, tracer)
        self.runner = runner
        self.stats.revision.set(-1 if runner.served.revision is None else runner.served.revision)
        if runner.served.revision is not None:  # a live artifact: follow its published revision (serving/model/revisions.py)
            threading.Thread(target=self._follow_revisions, name="fusionserve-revisions", daemon=True).start()
        self._ready_at = 0.0
        self._headers = {f"x-fusionserve-{k}": v for k, v in self.where.items()}
        _serve_with(self)

    def _follow_revisions(self) -> None:
        """Poll the revision pointer (a stat) every ``_REVISION_POLL_S``; a revision that does not load keeps the old."""
        while True:
            time.sleep(_REVISION_POLL_S)
            try:
                if self.runner.refresh():
                    self.stats.revision.set(self.runner.served.revision or 0)
                    self.stats.revision_loads.labels("loaded").inc()
                    log.info("now serving revision %s: %s", self.runner.served.revision, ", ".join(self.runner.artifact.tasks))
            except Exception as exc:  # a bad revision, or the file system (EIO, ESTALE on NFS, EACCES): never the end of it
                self.stats.revision_loads.labels("failed").inc()
                log.error("revision not loaded, still serving revision %s: %s: %s", self.runner.served.revision,
                          type(exc).__name__, exc)  # fmt: skip
                time.sleep(_REVISION_POLL_S * 10)  # the same failure, checked again a little later

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve's ``user_config``: a revision from ``fusionserve tasks config``, for nodes that do not share the folder:
        written into this node's copy, then served. Raises RevisionError (Serve keeps the config the replicas had)."""
        if config.get("revision") is None:
            return
        revisions.install(self.runner.artifact.folder, config)
        if self.runner.refresh():
            self.stats.revision.set(self.runner.served.revision or 0)
            self.stats.revision_loads.labels("loaded").inc()

    def _on_batch(self, batch: BatchStats) -> None:
        self.stats.observe_batch(batch)  # labelled with the batch's own revision's adapters (serving/scheduler/results.py)

    # --- routes ---------------------------------------------------------------------------------------------

    @app.post(
        "/v1/classify",
        response_model=ClassifyResponse | MultiTaskResponse,
        openapi_extra={"requestBody": {"required": True, "content": {_JSON: {"schema": ClassifyRequest.model_json_schema()}}}},
        responses={
            404: {"description": "unknown task"},
            413: {"description": "too large"},
            415: {"description": "not application/json, or compressed"},
            422: {"description": "bad request body"},
            503: {"description": "overloaded: the replica's queue is full; retry later"},
        },
    )
    async def classify(self, request: Request) -> Response:
        """Classify texts (or text pairs) for one task, or for several ("tasks") in one call."""
        outcome = await self.core(
            lambda: self._read(request), "POST /v1/classify", request.headers.get(TIMEOUT_HEADER),
            traceparent=request.headers.get("traceparent"),
        )  # fmt: skip
        if isinstance(outcome, HTTPError):
            return _error(outcome.status, outcome.reason, outcome.message)
        return _json(outcome, headers=self._headers)

    @app.post("/predict", responses={404: {"description": "no --default-task"}, 422: {"description": "bad request body"}})
    async def predict(self, request: Request) -> Response:
        """TEI's /predict for the server's --default-task: a text, a pair [a, b] or a list of them (serving/api/tei.py);
        answers [{label, score}, ...] sorted by score, or a list of those for a list."""
        return await self._compatible(request, "/predict", nested=False)

    @app.post("/", responses={404: {"description": "no --default-task"}, 422: {"description": "bad request body"}})
    async def inference_api(self, request: Request) -> Response:
        """The Hugging Face Inference API's text classification for the --default-task ({"inputs", "parameters"});
        answers a list of [{label, score}, ...] per input, as huggingface_hub's InferenceClient reads it."""
        return await self._compatible(request, "/", nested=True)

    async def Classify(self, request: Any, grpc_context: Any = None) -> Any:
        """gRPC ``fusionserve.v1.Classifier/Classify``: the same path as POST /v1/classify (serving/api/grpc_ingress.py)."""
        return await classify_grpc(self.core, request, grpc_context, self.where, self.keys)

    @app.get("/v1/tasks")
    async def tasks(self) -> Response:
        """Served tasks with their heads, labels and adapters, the limits, and (a live artifact) the revision served."""
        return _json(describe_tasks(self.runner.artifact, self.limits), headers=self._headers)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        """The replica is alive."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "not ready: the model path fails (the error says how)"}})
    async def readyz(self) -> Response:
        """The model answers a real request (checked at most every 5 s)."""
        problem = await self.ready_problem()
        return _json(
            {"status": "ready"} if problem is None else {"status": "not ready", "error": problem}, 503 if problem else 200
        )

    async def ready_problem(self) -> str | None:
        """None when the model answers a real request (checked at most every 5 s), else what failed."""
        if time.monotonic() - self._ready_at > _READY_EVERY_S:
            entry = next(iter(self.runner.artifact.tasks.values()))
            try:
                await self.scheduler.submit(entry.name, (probe(head(entry)),))
            except Exception as exc:  # any failure of the model path means not ready; say which
                return bounded(f"{type(exc).__name__}: {exc}")
            self._ready_at = time.monotonic()
        return None

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

    @app.get(
        "/metrics", response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
                   401: {"description": "--private-metrics and no or a wrong API key"}},
    )  # fmt: skip
    async def metrics(self) -> Response:
        """Prometheus text format (all replicas on this node, see serving/api/metrics.py)."""
        body, content_type = self.stats.render()
        return Response(body, media_type=content_type)

    # --- helpers --------------------------------------------------------------------------------------------

    async def _compatible(self, request: Request, route: str, nested: bool) -> Response:
        task = self.default_task
        if task is None:
            return _error(404, "not_found", f"POST {route}: this server has no default task (start it with --default-task TASK)")
        entry = self.runner.artifact.tasks.get(task)  # gone (a live revision removed it): the classify path says 404
        refusal = entry and unsupported(task, head(entry))
        if refusal:
            return _error(422, "unsupported_task", refusal)
        shape: dict[str, Any] = {}

        async def read() -> ClassifyRequest:
            req, shape["batch"], shape["answer"] = read_request(await self._read_body(request), task)
            return req

        outcome = await self.core(
            read, f"POST {route}", request.headers.get(TIMEOUT_HEADER), traceparent=request.headers.get("traceparent")
        )
        if isinstance(outcome, HTTPError):
            return _error(outcome.status, outcome.reason, outcome.message)
        preds = predictions(outcome, shape["answer"])
        return _json(preds if nested or shape["batch"] else preds[0], headers=self._headers)

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.limits)

    async def _read(self, request: Request) -> ClassifyRequest:
        return parse_json(await self._read_body(request))
