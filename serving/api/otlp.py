"""OTLP/HTTP export of spans, written as protobuf directly (serving/api/tracing.py makes a request's spans here).

Why not the SDK's tracer, batch processor and exporter: in a replica at 16 clients they cost ~590 µs of CPU a
request (a Python ``Span`` per span with its lock and the processor's hooks, the encoder walking them again, the
export thread), about 4% of the replica's CPU on the built-in model; built as ``opentelemetry.proto`` messages (upb,
C) and sent from the thread that makes them, ~170 µs (figures: benchmarks/RESULTS.md, "Tracing (OpenTelemetry)").

The settings are OpenTelemetry's own variables, read once when the tracer starts: ``OTEL_EXPORTER_OTLP_[TRACES_]
HEADERS`` (``key=value,...``, values URL-encoded), ``..._TIMEOUT`` (seconds, as the Python SDK reads it; default 10),
``..._COMPRESSION`` (``gzip`` or none), ``..._CERTIFICATE`` (a CA file for https), ``..._CLIENT_CERTIFICATE`` and
``..._CLIENT_KEY`` (a client certificate for https), and the batch processor's
``OTEL_BSP_SCHEDULE_DELAY`` (ms, default 5000), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (spans, 512) and
``OTEL_BSP_MAX_QUEUE_SIZE`` (requests waiting to be made into spans, 2048; past it a request's trace is dropped).
"""

from __future__ import annotations

import gzip
import http.client
import logging
import os
import random
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

SERVER, INTERNAL = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_INTERNAL
_RETRIED = {429, 502, 503, 504}  # the statuses OTLP/HTTP says to retry
_log = logging.getLogger("ray.serve").getChild("fusionserve")


def _env(name: str, default: str | None = None) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``, else ``default``."""
    found = os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")
    return found.strip() if found and found.strip() else default


def _number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        raise ValueError(f"{name} = {os.environ[name]!r} is not a number") from None


@dataclass
class Settings:
    """Where and how spans are sent (see the module docstring); ``from_env`` reads OpenTelemetry's variables."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0
    gzip: bool = False
    certificate: str | None = None
    client_certificate: tuple[str, str | None] | None = None  # a client certificate file and its key file (mTLS)
    delay_s: float = 5.0
    batch_spans: int = 512
    queue_size: int = 2048

    @classmethod
    def from_env(cls, url: str) -> Settings:
        pairs = [p.split("=", 1) for p in (_env("HEADERS") or "").split(",") if "=" in p]
        compression = (_env("COMPRESSION") or "none").lower()
        if compression not in ("gzip", "none"):
            raise ValueError(f"OTEL_EXPORTER_OTLP_COMPRESSION = {compression!r}: gzip or none")
        return cls(
            url,
            {unquote(k).strip().lower(): unquote(v).strip() for k, v in pairs},
            float(_env("TIMEOUT") or 10),
            compression == "gzip",
            _env("CERTIFICATE"),
            (cert, _env("CLIENT_KEY")) if (cert := _env("CLIENT_CERTIFICATE")) else None,
            _number("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
            max(1, int(_number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))),
            max(1, int(_number("OTEL_BSP_MAX_QUEUE_SIZE", 2048))),
        )


def value(v: Any) -> AnyValue:
    """An attribute's value as OTLP writes it (str, bool, int, float, or a sequence of them)."""
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(array_value=ArrayValue(values=[value(x) for x in v]))


def attributes(found: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in found.items()]


def span_id() -> bytes:
    return (random.getrandbits(64) or 1).to_bytes(8, "big")


def span(trace_id: bytes, sid: bytes, parent: bytes, name: str, start_ns: int, end_ns: int, kind: int = INTERNAL,
         attrs: Mapping[str, Any] | None = None, error: str | None = None) -> Span:  # fmt: skip
    """One span; ``error``: the status message of an error span."""
    s = Span(trace_id=trace_id, span_id=sid, parent_span_id=parent, name=name, kind=kind,
             start_time_unix_nano=start_ns, end_time_unix_nano=max(start_ns, end_ns))  # fmt: skip
    if attrs:
        s.attributes.extend(attributes(attrs))
    if error is not None:
        s.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message=error))
    return s


class Exporter:
    """Posts batches of spans, one keep-alive connection; a failed batch is retried (429, 502-504, a broken
    connection) with backoff within the timeout, then dropped and logged, never raised."""

    def __init__(self, settings: Settings, resource: Mapping[str, Any]) -> None:
        self.settings = settings
        where = urlsplit(settings.url)
        if where.scheme not in ("http", "https") or not where.hostname:
            raise ValueError(f"the OTLP endpoint {settings.url!r} is not an http(s) URL")
        self._https, self._host, self._port = where.scheme == "https", where.hostname, where.port
        self._path = where.path + (f"?{where.query}" if where.query else "")
        self._resource = Resource(attributes=attributes(resource))
        self._scope = InstrumentationScope(name="fusionserve")
        self._headers = {"content-type": "application/x-protobuf"} | settings.headers
        if settings.gzip:
            self._headers["content-encoding"] = "gzip"
        self._conn: http.client.HTTPConnection | None = None
        self.exported = self.dropped = 0  # spans

    def encode(self, spans: Sequence[Span]) -> bytes:
        scoped = ScopeSpans(scope=self._scope, spans=spans)
        body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(resource=self._resource, scope_spans=[scoped])])
        data = body.SerializeToString()
        return gzip.compress(data, compresslevel=6) if self.settings.gzip else data

    def export(self, spans: Sequence[Span]) -> bool:
        body, until, pause = self.encode(spans), time.monotonic() + self.settings.timeout_s, 0.5
        while True:
            try:
                status, text = self._post(body, max(0.1, until - time.monotonic()))
            except (OSError, http.client.HTTPException) as exc:
                self._close()
                status, text = None, str(exc)
            if status is not None and 200 <= status < 300:
                self.exported += len(spans)
                return True
            if (status is not None and status not in _RETRIED) or time.monotonic() + pause > until:
                self.dropped += len(spans)
                _log.warning("OTLP export to %s failed (%s): %d spans dropped", self.settings.url, status or text, len(spans))
                return False
            time.sleep(pause)
            pause *= 2

    def _post(self, body: bytes, timeout_s: float) -> tuple[int, str]:
        if self._conn is None:
            if self._https:
                context = ssl.create_default_context(cafile=self.settings.certificate)
                if self.settings.client_certificate is not None:
                    context.load_cert_chain(*self.settings.client_certificate)
                self._conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s, context=context)
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        self._conn.timeout = timeout_s
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout_s)
        self._conn.request("POST", self._path, body, self._headers)
        answer = self._conn.getresponse()
        text = answer.read()[:200].decode("utf-8", "replace")
        if answer.will_close:
            self._close()
        return answer.status, text

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
