"""For the Open Inference Protocol tests: Triton's client in its own environment (a worker subprocess, see
tests/triton_env.py), an OTLP/HTTP receiver that decodes the SDK's export requests, and raw HTTP calls."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests import triton_env
from tests.serving_helpers import free_port


class Triton:
    """tritonclient, driven through tests/triton_worker.py in the tritonclient environment."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [str(triton_env.python()), str(triton_env.WORKER)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tritonclient worker ended: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class Receiver:
    """An OTLP/HTTP collector on 127.0.0.1: every span of every export request it was sent, decoded."""

    port: int
    spans: list[Span] = field(default_factory=list)
    resources: list[dict[str, Any]] = field(default_factory=list)  # each export request's resource attributes
    requests: int = 0
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trace(self, trace_id: str, root: str | None = None, within_s: float = 20) -> list[Span]:
        """The spans of ``trace_id`` (once its root, the span named ``root`` or the one without a parent of its own
        trace, is in)."""
        until = time.monotonic() + within_s
        while time.monotonic() < until:
            found = [s for s in list(self.spans) if s.trace_id == trace_id]
            if any(s.name == root if root else s.kind_root for s in found):  # type: ignore[attr-defined]
                return found
            time.sleep(0.1)
        return [s for s in list(self.spans) if s.trace_id == trace_id]


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def start_receiver() -> Receiver:
    """Start the receiver (a daemon thread); it answers every export with an empty ExportTraceServiceResponse."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

    receiver = Receiver(free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            request = ExportTraceServiceRequest.FromString(body)
            for resource in request.resource_spans:
                receiver.resources.append({a.key: _value(a.value) for a in resource.resource.attributes})
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        span = Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.start_time_unix_nano,
                                    s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes}, s.status.code == 2)  # fmt: skip
                        span.kind_root = s.kind == 2  # type: ignore[attr-defined]  # SPAN_KIND_SERVER: the request's root
                        receiver.spans.append(span)
            receiver.requests += 1
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    receiver.server = ThreadingHTTPServer(("127.0.0.1", receiver.port), Handler)
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float = 30) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One HTTP request on a fresh connection: (status, headers with lower-case names, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def bytes_tensor(texts: list[str]) -> bytes:
    """A BYTES tensor's raw form (4-byte little-endian length, then the UTF-8 bytes, per element)."""
    return b"".join(len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts)
