"""OpenTelemetry traces of requests, and the trace id in log lines.

With an OTLP endpoint (``--otlp-endpoint URL``, or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` in the replica's environment), every request gets one trace (a sampled share of
them: ``--trace-sample-ratio``, and an incoming ``traceparent``'s sampled flag is followed), exported over OTLP/HTTP
(protobuf; serving/api/otlp.py, the ``otel`` extra): a root span named for the route (``POST /v1/classify``,
``inference.GRPCInferenceService/ModelInfer``, ...) with, in order, ``parse`` (reading and validating the request),
``tokenize``, ``queue`` (waiting for a batch), one ``batch`` per model call its rows ran in (its size, tokens, tasks
and revision as attributes) holding ``model`` (padding and ONNX Runtime), and ``respond`` (the answer built). An
incoming W3C ``traceparent`` (HTTP header, gRPC metadata) makes the root a child of the caller's span.

Where the request entered: behind HAProxy (the default ingress), HAProxy stamps every request with the instant its
first byte arrived (``INGRESS_HEADER``: ``t=`` epoch microseconds when HAProxy had the request, ``r=`` the
milliseconds it took to arrive, ``k=`` the run's ingress key; serving/process/haproxy_rules.py), overwriting whatever
the client sent under that name. The root span starts there, and an ``ingress`` span covers HAProxy, the hop to the
replica, uvicorn and Serve's request path up to fusionserve's code. The stamp is believed only with the key HAProxy's
config holds (``INGRESS_KEY_FILE`` beside it, read once when the tracer starts): a request that did not come through
that HAProxy (Serve's proxy ingress, a node started without fusionserve's rules, the replica's own port) starts its
root where the replica got it. Over HTTP the root and ``respond`` end when the answer's last byte was handed to the
server (uvicorn, or Serve's proxy), serialisation included (``TraceEdge``); over gRPC when the method returned.

The request path only notes ``time.perf_counter()`` instants (the scheduler notes its own: ``JobResult``); the spans
are made from them afterwards, in a thread of their own, which sends them in batches (serving/api/otlp.py): a
request waits for neither. Without an endpoint no tracer exists, nothing of OpenTelemetry is imported, and a
request pays one ``is None`` test.
"""

from __future__ import annotations

import atexit
import contextvars
import hmac
import logging
import os
import queue
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionserve.errors import FusionServeError
from fusionserve.settings import otlp_env

from ..private import HAPROXY_CONFIG_ENV
from ..scheduler.results import JobResult

# the trace id of the request being handled (when it has one), for log lines (``TraceIdFilter``)
TRACE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("fusionserve_trace_id", default=None)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
INGRESS_HEADER = "x-fusionserve-ingress"  # HAProxy's stamp (serving/process/haproxy_rules.py)
INGRESS_KEY_FILE = "ingress.key"  # beside HAProxy's config: the key its stamps carry
_STAMP = re.compile(r"^t=(\d{1,19}) r=(-?\d{1,9}) k=([0-9a-f]{32})$")
_STAMP_OLDEST_S = 3600.0  # a stamp older than this (a clock stepped back, a stuck connection) is not believed


def ingress_key(config: str | None = None) -> str | None:
    """The key of the HAProxy whose config is at ``config`` (default: ``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC`` in this
    process's environment, which a replica inherits from the server that started Ray), or None where there is none."""
    config = config or os.environ.get(HAPROXY_CONFIG_ENV)
    try:
        return (Path(config).parent / INGRESS_KEY_FILE).read_text().strip() if config else None
    except OSError:
        return None


def ingress_instant(stamp: str | None, key: str | None, now_s: float, now_ns: int) -> float | None:
    """The ``time.perf_counter()`` instant (on the clock where ``now_s`` and the epoch ``now_ns`` were read together)
    at which the ingress got the first byte of the request whose ``INGRESS_HEADER`` is ``stamp``; None when there is no
    stamp, it is malformed, it does not carry ``key`` (not HAProxy's: a client's), or it is older than an hour. A
    stamp after ``now`` (another node's clock) counts as now."""
    found = _STAMP.match(stamp.strip()) if stamp and key else None
    if found is None or not hmac.compare_digest(found.group(3), key or ""):
        return None
    first_byte_us = int(found.group(1)) - max(0, int(found.group(2))) * 1000
    ago_s = max(0.0, (now_ns // 1000 - first_byte_us) / 1e6)
    return None if ago_s > _STAMP_OLDEST_S else now_s - ago_s


def _valid_traceparent(traceparent: str | None) -> re.Match[str] | None:
    """A valid W3C ``traceparent`` value (version 00 form, ids not all zero) parsed: version, trace id, parent id,
    flags; else None."""
    found = _TRACEPARENT.match(traceparent.strip().lower()) if traceparent else None
    if found is None or found.group(1) == "ff" or set(found.group(2)) == {"0"} or set(found.group(3)) == {"0"}:
        return None
    return found


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent`` value (version 00 form, ids not all zero), else None."""
    found = _valid_traceparent(traceparent)
    return None if found is None else found.group(2)


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
    ingress_s: float | None = None  # when the ingress (HAProxy) got its first byte, where it said so
    reached_s: float | None = None  # when fusionserve's code got it (the outermost middleware), if before arrived_s
    sent_s: float | None = None  # when the answer's last byte was handed to the HTTP server


@dataclass
class Edge:
    """A request as fusionserve's outermost code met it (``TraceEdge``, or a gRPC method): when, HAProxy's instant,
    and (``records``) whether the edge hands the trace to the tracer itself once the answer is sent."""

    reached_s: float
    ingress_s: float | None = None
    records: bool = False
    trace: RequestTrace | None = None


EDGE: contextvars.ContextVar[Edge | None] = contextvars.ContextVar("fusionserve_trace_edge", default=None)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (``http://host:4318``) or of the full URL."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class Tracer:
    """Makes and exports the spans of requests (see the module docstring). Raises FusionServeError when the
    OpenTelemetry SDK or its OTLP protobuf messages are not installed, or the environment asks for OTLP over gRPC
    or holds a setting it cannot read."""

    def __init__(self, endpoint: str | None, sample_ratio: float, resource: dict[str, str] | None = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

            from . import otlp
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
        attributes = {"service.name": "fusionserve"} if not env.get("service_name") else {}
        try:  # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME as the SDK reads them, and its telemetry.sdk.* ones
            self.settings = otlp.Settings.from_env(traces_url(endpoint or env.get("endpoint", "")))
            self.exporter = otlp.Exporter(self.settings, Resource.create(attributes | (resource or {})).attributes)
        except ValueError as exc:
            raise FusionServeError(f"tracing: {exc}") from None
        self._otlp = otlp
        self._bound = TraceIdRatioBased(sample_ratio).bound  # the SDK's rule: the trace id's low 64 bits below it
        self.ingress_key = ingress_key()  # None: no HAProxy of fusionserve's here, no stamp believed
        self._todo: queue.SimpleQueue[RequestTrace | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self.dropped = 0  # requests whose trace was dropped: the queue full
        self._thread = threading.Thread(target=self._work, name="fusionserve-traces", daemon=True)
        self._thread.start()
        atexit.register(self.flush)  # what is waiting is sent when the replica exits

    def new_trace_id(self) -> str:
        return f"{random.getrandbits(128) or 1:032x}"

    def edge(self, stamp: str | None, records: bool = False) -> Edge:
        """The request met now, with its ingress stamp (``INGRESS_HEADER``'s value, or None)."""
        now_s, now_ns = time.perf_counter(), time.time_ns()
        return Edge(now_s, ingress_instant(stamp, self.ingress_key, now_s, now_ns), records)

    def record(self, trace: RequestTrace) -> None:
        """Hand a finished request's instants over; its spans are made in the tracer's own thread (dropped past
        ``OTEL_BSP_MAX_QUEUE_SIZE`` requests waiting: a collector that does not answer costs no memory)."""
        if self._todo.qsize() < self.settings.queue_size:
            self._todo.put(trace)
        else:
            self.dropped += 1

    def _work(self) -> None:
        """Make each request's spans as it comes; send them every ``OTEL_BSP_SCHEDULE_DELAY``, or at once when
        ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` are waiting. A None handed over sends what is waiting now."""
        spans: list[Any] = []
        due = time.monotonic() + self.settings.delay_s
        while True:
            try:
                trace = self._todo.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                trace = None
            if trace is not None:
                try:
                    self._spans(trace, spans)
                except Exception:  # a span that cannot be made must not stop the ones after it
                    logging.getLogger("ray.serve").getChild("fusionserve").exception("could not make the spans of a request")
                if len(spans) < self.settings.batch_spans and time.monotonic() < due:
                    continue
            while spans:
                batch, spans = spans[: self.settings.batch_spans], spans[self.settings.batch_spans :]
                try:
                    self.exporter.export(batch)
                except Exception:  # the exporter's own failures are logged there; anything else must not stop tracing
                    logging.getLogger("ray.serve").getChild("fusionserve").exception("could not export spans")
            due = time.monotonic() + self.settings.delay_s
            if self._todo.empty():
                self._idle.set()

    def _spans(self, t: RequestTrace, out: list[Any]) -> None:
        """Append the request's spans to ``out``, unless it is not sampled: a caller's ``traceparent`` decides by its
        flag (the SDK's ParentBased), otherwise the ratio (TraceIdRatioBased) by the trace id."""
        o = self._otlp
        caller = _valid_traceparent(t.traceparent)
        if caller is not None:
            if not int(caller.group(4), 16) & 1:
                return
            trace_id, parent = bytes.fromhex(caller.group(2)), bytes.fromhex(caller.group(3))
        elif int(t.trace_id[16:], 16) < self._bound:
            trace_id, parent = bytes.fromhex(t.trace_id), b""
        else:
            return
        # perf_counter -> epoch, taken again for each request (moments after it ended): a clock slewed since the
        # tracer started does not shift its spans against the instants of other processes (HAProxy's stamp, a client)
        offset = time.time_ns() - int(time.perf_counter() * 1e9)

        def ns(seconds: float) -> int:
            return int(seconds * 1e9) + offset

        root = o.span_id()

        def child(name: str, start: float, end: float, under: bytes = root, attrs: dict | None = None) -> bytes:
            sid = o.span_id()
            out.append(o.span(trace_id, sid, under, name, ns(start), ns(max(start, end)), attrs=attrs))
            return sid

        reached = min(t.reached_s or t.arrived_s, t.arrived_s)
        start, end = min(t.ingress_s or reached, reached), max(t.sent_s or t.answered_s, t.answered_s)
        attrs: dict[str, Any] = {"fusionserve.task": t.task, "fusionserve.inputs": t.inputs, "fusionserve.status": t.status}
        if t.error_type is not None:
            attrs["fusionserve.error_type"] = t.error_type
        out.append(o.span(trace_id, root, parent, t.name, ns(start), ns(end), o.SERVER, attrs, t.error_type))
        if t.ingress_s is not None:  # HAProxy, the hop to the replica, uvicorn, Serve's request path
            child("ingress", start, reached)
        child("parse", reached, t.parsed_s if t.parsed_s is not None else end)
        r = t.result
        if r is not None and r.spans:
            child("tokenize", r.submitted_s, r.tokenized_s)
            child("queue", r.tokenized_s, r.spans[0].taken_s)
            for b in r.spans:
                batch = child("batch", b.taken_s, b.model_end_s, attrs={
                    "fusionserve.batch.size": b.inputs, "fusionserve.batch.tokens": b.tokens,
                    "fusionserve.batch.tasks": list(b.tasks), "fusionserve.revision": -1 if b.revision is None else b.revision,
                })  # fmt: skip
                child("model", b.model_start_s, b.model_end_s, under=batch)
            child("respond", r.spans[-1].model_end_s, end)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Send every span handed over so far; True when done within ``timeout_s``."""
        self._idle.clear()
        self._todo.put(None)
        return self._idle.wait(timeout_s)

    def shutdown(self) -> None:
        """Export what is left (waits for the spans handed over so far)."""
        self.flush()


class TraceEdge:
    """ASGI middleware, the outermost: with a tracer (``tracer()`` not None), notes when an HTTP request reached
    fusionserve's code and HAProxy's stamp (``Edge``, in ``EDGE`` for the Classifier), and hands the request's trace
    to the tracer once the answer's last byte was handed to the server, so that the root and ``respond`` spans
    cover the answer's serialisation and sending. Without a tracer: one call and one ``is None`` test."""

    def __init__(self, app: Any, tracer: Callable[[], Tracer | None]) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        tracer = self.tracer()
        if tracer is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stamp = next((v for k, v in scope["headers"] if k == _INGRESS_BYTES), None)
        edge = tracer.edge(stamp.decode("latin-1") if stamp is not None else None, records=True)
        sent: list[float] = []

        async def sending(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                sent.append(time.perf_counter())

        token = EDGE.set(edge)
        try:
            await self.app(scope, receive, sending)
        finally:
            EDGE.reset(token)
            if edge.trace is not None:
                edge.trace.sent_s = sent[0] if sent else None
                tracer.record(edge.trace)


_INGRESS_BYTES = INGRESS_HEADER.encode()


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
