"""OpenTelemetry traces of requests, and the trace id in log lines.

With an OTLP endpoint (``--otlp-endpoint URL``, or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` in the replica's environment), every request gets one trace (a sampled share of
them: ``--trace-sample-ratio``, and an incoming ``traceparent``'s sampled flag is followed), exported over OTLP/HTTP
(protobuf) by the OpenTelemetry SDK (the ``otel`` extra): a root span named for the route (``POST /v1/classify``,
``inference.GRPCInferenceService/ModelInfer``, ...) with, in order, ``parse`` (reading and validating the request),
``tokenize``, ``queue`` (waiting for a batch), one ``batch`` per model call its rows ran in (its size, tokens, tasks
and revision as attributes) holding ``model`` (padding and ONNX Runtime), and ``respond`` (the answer built). An
incoming W3C ``traceparent`` (HTTP header, gRPC metadata) makes the root a child of the caller's span.

The request path only notes ``time.perf_counter()`` instants (the scheduler notes its own: ``JobResult``); the spans
are made from them afterwards, in a thread of their own, and the SDK's batch processor exports them from another: a
request waits for neither. Without an endpoint no tracer exists, nothing of OpenTelemetry is imported, and a
request pays one ``is None`` test.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from fusionserve.errors import FusionServeError
from fusionserve.settings import otlp_env

from ..scheduler.results import JobResult

# the trace id of the request being handled (when it has one), for log lines (``TraceIdFilter``)
TRACE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("fusionserve_trace_id", default=None)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent`` value (version 00 form, ids not all zero), else None."""
    found = _TRACEPARENT.match(traceparent.strip().lower()) if traceparent else None
    if found is None or found.group(1) == "ff" or set(found.group(2)) == {"0"} or set(found.group(3)) == {"0"}:
        return None
    return found.group(2)


@dataclass
class RequestTrace:
    """One request's instants (``time.perf_counter()`` seconds) and outcome, from which its spans are made."""

    name: str
    traceparent: str | None
    trace_id: str
    arrived_s: float
    parsed_s: float | None = None
    answered_s: float = 0.0
    status: int = 0
    error_type: str | None = None
    task: str = "-"
    inputs: int = 0
    result: JobResult | None = None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (``http://host:4318``) or of the full URL."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class Tracer:
    """Makes and exports the spans of requests (see the module docstring). Raises FusionServeError when the
    OpenTelemetry SDK or its OTLP/HTTP exporter is not installed, or the environment asks for OTLP over gRPC."""

    def __init__(self, endpoint: str | None, sample_ratio: float, resource: dict[str, str] | None = None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise FusionServeError(
                f"tracing needs the OpenTelemetry SDK and its OTLP exporter ({exc.name} is missing): "
                "pip install 'fusionserve[otel]'"
            ) from None
        env = otlp_env()
        if env.get("protocol", "http/protobuf") != "http/protobuf":
            raise FusionServeError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL = {env['protocol']!r}: fusionserve exports traces over OTLP/HTTP "
                "(http/protobuf) only; point it at the collector's HTTP port (4318)"
            )

        class _Ids(RandomIdGenerator):
            """The request's own trace id (made when it arrived, so its log lines carry it) for a root span."""

            next_trace_id: int | None = None

            def generate_trace_id(self) -> int:
                chosen, self.next_trace_id = self.next_trace_id, None
                return chosen if chosen is not None else super().generate_trace_id()

        attributes = {"service.name": "fusionserve"} if not env.get("service_name") else {}
        self._ids = _Ids()
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            resource=Resource.create(attributes | (resource or {})),
            id_generator=self._ids,
        )
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("fusionserve")
        self._propagator = TraceContextTextMapPropagator()
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)  # perf_counter seconds -> epoch ns
        self._todo: queue.SimpleQueue[RequestTrace] = queue.SimpleQueue()
        threading.Thread(target=self._work, name="fusionserve-traces", daemon=True).start()

    def new_trace_id(self) -> str:
        return f"{random.getrandbits(128) or 1:032x}"

    def record(self, trace: RequestTrace) -> None:
        """Hand a finished request's instants over; its spans are made in the tracer's own thread."""
        self._todo.put(trace)

    def _work(self) -> None:
        while True:
            trace = self._todo.get()
            try:
                self._spans(trace)
            except Exception:  # a span that cannot be made must not stop the ones after it
                logging.getLogger("ray.serve").getChild("fusionserve").exception("could not make the spans of a request")

    def _ns(self, seconds: float) -> int:
        return int(seconds * 1e9) + self._offset_ns

    def _spans(self, t: RequestTrace) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        parent = self._propagator.extract({"traceparent": t.traceparent}) if t.traceparent else None
        if trace_id_of(t.traceparent) is None:  # a root of its own: with the id its log lines carry
            self._ids.next_trace_id = int(t.trace_id, 16)
        attrs: dict[str, Any] = {"fusionserve.task": t.task, "fusionserve.inputs": t.inputs, "fusionserve.status": t.status}
        root = self._tracer.start_span(
            t.name, context=parent, kind=SpanKind.SERVER, start_time=self._ns(t.arrived_s), attributes=attrs
        )
        self._ids.next_trace_id = None
        if not root.is_recording():  # sampled out
            return
        inside = set_span_in_context(root)

        def child(name: str, start: float, end: float, context: Any = inside, **attributes: Any) -> Any:
            span = self._tracer.start_span(name, context=context, start_time=self._ns(start), attributes=attributes)
            span.end(end_time=self._ns(max(start, end)))
            return span

        child("parse", t.arrived_s, t.parsed_s if t.parsed_s is not None else t.answered_s)
        r = t.result
        if r is not None and r.spans:
            child("tokenize", r.submitted_s, r.tokenized_s)
            child("queue", r.tokenized_s, r.spans[0].taken_s)
            for b in r.spans:
                batch = self._tracer.start_span("batch", context=inside, start_time=self._ns(b.taken_s), attributes={
                    "fusionserve.batch.size": b.inputs, "fusionserve.batch.tokens": b.tokens,
                    "fusionserve.batch.tasks": list(b.tasks), "fusionserve.revision": -1 if b.revision is None else b.revision,
                })  # fmt: skip
                child("model", b.model_start_s, b.model_end_s, context=set_span_in_context(batch))
                batch.end(end_time=self._ns(b.model_end_s))
            child("respond", r.spans[-1].model_end_s, t.answered_s)
        if t.error_type is not None:
            root.set_attribute("fusionserve.error_type", t.error_type)
            root.set_status(Status(StatusCode.ERROR, t.error_type))
        root.end(end_time=self._ns(t.answered_s))

    def shutdown(self) -> None:
        """Export what is left (waits for the spans handed over so far)."""
        deadline = time.monotonic() + 5
        while not self._todo.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.provider.shutdown()


def tracer_from(endpoint: str | None, sample_ratio: float, resource: dict[str, str] | None = None) -> Tracer | None:
    """A tracer when an endpoint is given or the OTLP environment names one; None (nothing started) otherwise."""
    if endpoint is None and not otlp_env().get("endpoint"):
        return None
    return Tracer(endpoint, sample_ratio, resource)


_BY_REQUEST: dict[str, str] = {}  # Serve's request id -> the request's trace id, while JSON logs are on
_KEEP = 4096  # the newest requests' ids kept (a request's lines are written while it is handled)
_json_logs = False


def note_request(trace_id: str) -> None:
    """With JSON logs on: remember the trace id of the Serve request being handled, so that Serve's own lines about
    it (its access line, written after the handler returns, outside this request's context) carry it too."""
    if not _json_logs:
        return
    try:  # Serve's request context (a private API: without it, only fusionserve's own lines carry the id)
        from ray.serve.context import _get_serve_request_context

        request_id = _get_serve_request_context().request_id
    except Exception:
        return
    if request_id:
        _BY_REQUEST[request_id] = trace_id
        if len(_BY_REQUEST) > _KEEP:
            del _BY_REQUEST[next(iter(_BY_REQUEST))]


class TraceIdFilter(logging.Filter):
    """Adds ``trace_id`` to every record logged about a request that has a trace (Ray Serve's JSON log format
    writes a record's extra attributes as fields): in the request's own context, or by its Serve request id."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace_id = TRACE_ID.get() or _BY_REQUEST.get(getattr(record, "request_id", None) or "")
        if trace_id is not None:
            record.trace_id = trace_id
        return True


def log_json_with_trace_ids() -> None:
    """In a replica whose Serve logs are JSON: every record that passes through Serve's handlers gets the trace id."""
    global _json_logs
    _json_logs = True
    serve_logger = logging.getLogger("ray.serve")
    for handler in serve_logger.handlers:
        if not any(isinstance(f, TraceIdFilter) for f in handler.filters):
            handler.addFilter(TraceIdFilter())
