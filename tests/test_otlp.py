"""The tracer's spans and their OTLP/HTTP export (serving/api/tracing.py, serving/api/otlp.py), without a server: a
request's instants handed to a real Tracer, the spans as a real OTLP/HTTP receiver (tests/oip_helpers.py) decoded
them, OpenTelemetry's settings from the environment, a collector that fails, and the CPU a request's spans cost."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from fusionserve.errors import FusionServeError
from fusionserve.serving.api.tracing import RequestTrace, Tracer
from fusionserve.serving.process.ingress import free_port
from fusionserve.serving.scheduler.results import BatchSpan, JobResult
from tests.oip_helpers import start_receiver

STAGES = ["ingress", "parse", "tokenize", "queue", "batch", "respond"]


@pytest.fixture(scope="module")
def receiver():
    r = start_receiver()
    yield r
    r.server.shutdown()


@pytest.fixture
def otel_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    return monkeypatch


def _request(tracer: Tracer, traceparent: str | None = None, error: str | None = None, batches: int = 1) -> RequestTrace:
    now = time.perf_counter()
    spans = tuple(
        BatchSpan(now + 0.003 + k * 0.01, now + 0.004 + k * 0.01, now + 0.010 + k * 0.01, 4, 64, ("rte", "nli"), None)
        for k in range(batches)
    )
    result = JobResult({}, [False], 1.0, batches, now + 0.001, now + 0.002, spans)
    return RequestTrace("POST /v1/classify", traceparent, tracer.new_trace_id(), now, parsed_s=now + 0.0005,
                        answered_s=now + 0.011 + batches * 0.01, status=422 if error else 200, error_type=error,
                        task="rte", inputs=1, result=result, ingress_s=now - 0.001, reached_s=now,
                        sent_s=now + 0.012 + batches * 0.01)  # fmt: skip


def test_a_requests_spans_reach_the_collector_with_their_parents_attributes_and_resource(receiver, otel_env):
    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    tracer = Tracer(receiver.endpoint, 1.0, {"fusionserve.task_set": "default"})
    trace = _request(tracer, batches=2)
    tracer.record(trace)
    assert tracer.flush(10)
    spans = receiver.trace(trace.trace_id, "POST /v1/classify")
    names = sorted(s.name for s in spans)
    assert names == sorted(["POST /v1/classify", *STAGES, "batch", "model", "model"]), names
    by = {s.name: s for s in spans}
    root = by["POST /v1/classify"]
    assert root.parent_id == "" and root.kind_root and not root.error
    assert root.attributes == {"fusionserve.task": "rte", "fusionserve.inputs": 1, "fusionserve.status": 200}
    for s in spans:
        assert s.parent_id == (root.span_id if s.name != "model" and s is not root else s.parent_id)
    batches = [s for s in spans if s.name == "batch"]
    assert {s.parent_id for s in spans if s.name == "model"} == {b.span_id for b in batches}
    assert batches[0].attributes == {"fusionserve.batch.size": 4, "fusionserve.batch.tokens": 64,
                                     "fusionserve.batch.tasks": ["rte", "nli"], "fusionserve.revision": -1}  # fmt: skip
    assert by["ingress"].start_ns == root.start_ns and by["respond"].end_ns == root.end_ns
    assert abs(root.start_ns - time.time_ns()) < 60e9  # epoch nanoseconds
    assert receiver.resources[-1]["service.name"] == "fusionserve"
    assert receiver.resources[-1]["deployment.environment"] == "test"  # OTEL_RESOURCE_ATTRIBUTES, as the SDK reads it
    assert receiver.resources[-1]["fusionserve.task_set"] == "default"


def test_a_callers_traceparent_is_continued_and_its_sampled_flag_followed(receiver, otel_env):
    tracer = Tracer(receiver.endpoint, 0.0)  # the ratio samples nothing: the caller's flag decides
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    tracer.record(_request(tracer, f"00-{trace_id}-{parent}-01"))
    unsampled = os.urandom(16).hex()
    tracer.record(_request(tracer, f"00-{unsampled}-{parent}-00"))
    own = _request(tracer)  # no caller, ratio 0: not sampled
    tracer.record(own)
    assert tracer.flush(10)
    root = next(s for s in receiver.trace(trace_id, "POST /v1/classify") if s.name == "POST /v1/classify")
    assert root.parent_id == parent and root.trace_id == trace_id
    time.sleep(0.2)
    assert not [s for s in receiver.spans if s.trace_id in (unsampled, own.trace_id)]


def test_the_sample_ratio_keeps_about_its_share(receiver, otel_env):
    tracer = Tracer(receiver.endpoint, 0.25)
    traces = [_request(tracer) for _ in range(400)]
    for t in traces:
        tracer.record(t)
    assert tracer.flush(10)
    time.sleep(0.2)
    ids = {t.trace_id for t in traces}
    kept = {s.trace_id for s in receiver.spans if s.trace_id in ids}
    assert 60 <= len(kept) <= 140, len(kept)  # 100 expected; binomial sd ~8.7


def test_a_refused_request_is_an_error_span(receiver, otel_env):
    tracer = Tracer(receiver.endpoint, 1.0)
    trace = _request(tracer, error="invalid_input")
    tracer.record(trace)
    assert tracer.flush(10)
    root = next(s for s in receiver.trace(trace.trace_id, "POST /v1/classify") if s.name == "POST /v1/classify")
    assert root.error and root.attributes["fusionserve.error_type"] == "invalid_input"
    assert root.attributes["fusionserve.status"] == 422


class _Collector:
    """A collector that answers ``statuses`` in turn (then 200), noting each request's headers and decoded body."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses, self.seen = list(statuses), []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.seen.append((dict(self.headers), body))
                self.send_response(collector.statuses.pop(0) if collector.statuses else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"


def test_headers_compression_and_retries_as_opentelemetrys_variables_say(otel_env):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    otel_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer%20abc,x-tenant=blue")
    otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    collector = _Collector([503, 429])  # retried: the third try lands
    try:
        tracer = Tracer(collector.url, 1.0)
        trace = _request(tracer)
        tracer.record(trace)
        assert tracer.flush(20)
        assert len(collector.seen) == 3 and tracer.exporter.exported == 8 and tracer.exporter.dropped == 0
        headers, body = collector.seen[-1]
        assert headers["authorization"] == "Bearer abc" and headers["x-tenant"] == "blue"
        assert headers["content-type"] == "application/x-protobuf" and headers["content-encoding"] == "gzip"
        spans = ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
        assert {s.trace_id.hex() for s in spans} == {trace.trace_id}
    finally:
        collector.server.shutdown()


def test_a_collector_that_refuses_or_is_gone_costs_spans_not_the_server(otel_env, caplog):
    collector = _Collector([400])  # not retried
    try:
        tracer = Tracer(collector.url, 1.0)
        tracer.record(_request(tracer))
        assert tracer.flush(20)
        assert len(collector.seen) == 1 and tracer.exporter.dropped == 8
    finally:
        collector.server.shutdown()
        collector.server.server_close()
    otel_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    gone = Tracer(f"http://127.0.0.1:{free_port()}", 1.0)  # nothing listens
    gone.record(_request(gone))
    assert gone.flush(20) and gone.exporter.dropped == 8
    gone.record(_request(gone))  # the thread goes on after a failure
    assert gone.flush(20) and gone.exporter.dropped == 16
    assert "OTLP export to" in caplog.text


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", "gzip or none"),
        ("OTEL_BSP_SCHEDULE_DELAY", "soon", "not a number"),
    ],
)
def test_a_setting_that_cannot_be_used_is_refused_when_the_tracer_starts(otel_env, name, value, says):
    otel_env.setenv(name, value)
    with pytest.raises(FusionServeError, match=says):
        Tracer("http://127.0.0.1:4318", 1.0)


def test_the_queue_of_requests_is_bounded(otel_env):
    """A collector that takes the connection and never answers holds the export; the requests after it wait, at most
    OTEL_BSP_MAX_QUEUE_SIZE of them, the rest dropped (counted), never more memory."""
    otel_env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "3")
    otel_env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")  # one request's spans: sent at once
    otel_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1.5")
    with socket.create_server(("127.0.0.1", 0)) as mute:  # listens, never accepts: connects, no answer
        tracer = Tracer(f"http://127.0.0.1:{mute.getsockname()[1]}/v1/traces", 1.0)
        tracer.record(_request(tracer))
        time.sleep(0.5)  # its export is under way, and hangs
        for _ in range(50):
            tracer.record(_request(tracer))
        assert tracer.dropped == 47 and tracer._todo.qsize() == 3
        while not tracer._todo.empty():  # nothing left for after the test: its thread ends its hung export, then idles
            tracer._todo.get_nowait()
        assert tracer.flush(10)


def test_making_and_encoding_a_requests_spans_costs_little_cpu(receiver, otel_env):
    """Printed, not asserted as a time (benchmarks/RESULTS.md holds the figures): the CPU of making one request's
    eight spans and encoding them, in this thread; a regression to the SDK's span objects shows as ~8x."""
    tracer = Tracer(receiver.endpoint, 1.0)
    traces, out = [_request(tracer) for _ in range(500)], []
    started = time.thread_time()
    for t in traces:
        tracer._spans(t, out)
    tracer.exporter.encode(out)
    print(f"spans made and encoded: {(time.thread_time() - started) / len(traces) * 1e6:.0f} µs CPU a request")
    assert len(out) == 8 * len(traces)


def test_without_an_endpoint_no_tracer_exists_and_nothing_of_opentelemetry_is_imported():
    code = (
        "import os, sys\n"
        "[os.environ.pop(k) for k in list(os.environ) if k.startswith('OTEL_')]\n"
        "from fusionserve.serving.api import tracing\n"
        "assert tracing.tracer_from(None, 1.0) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry') or m.endswith('.otlp')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]", out
