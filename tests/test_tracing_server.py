"""End to end: OpenTelemetry traces of a real `fusionserve serve` (Ray Serve, ONNX Runtime, HAProxy) on 127.0.0.1,
exported to an OTLP/HTTP receiver in this process (tests/oip_helpers.py, conftest's ``otlp_receiver``), over every
ingress a request can take (/v1/classify, the Open Inference Protocol over HTTP and gRPC), with JSON logs carrying the
trace id. The traced server is conftest's ``oip_server``, shared with test_open_inference and test_openapi_description
(one group): an API key, gRPC, every request traced, --log-format json, and a 300 ms batch wait (a lone request waits
that long for company, which makes mixed batches testable on any machine). The tracer's spans and export without a
server: tests/test_otlp.py.
"""

import http.client
import json
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from fusionserve.serving.api import grpc_predict_v2_pb2 as v2
from fusionserve.serving.api import grpc_predict_v2_pb2_grpc as v2_grpc
from fusionserve.serving.api.tracing import INGRESS_HEADER
from tests.adapterhub_models import SENTENCES
from tests.oip_helpers import bytes_tensor, request
from tests.serving_helpers import OIP_KEY as KEY

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("oip_server")]

AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = {"authorization": f"Bearer {KEY}"}
TEXTS = [SENTENCES[0], SENTENCES[2], SENTENCES[4]]
_TEXT = {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}


@pytest.fixture
def receiver(otlp_receiver):
    """The receiver of the traced server's spans (every request's, within 100 ms)."""
    return otlp_receiver


@pytest.fixture
def server(oip_server):
    """conftest's traced server, with a stub (``stub``) of the inference service."""
    with grpc.insecure_channel(f"127.0.0.1:{oip_server.grpc_port}") as channel:
        oip_server.stub = v2_grpc.GRPCInferenceServiceStub(channel)
        yield oip_server


def _classify(server, task: str, inputs: list) -> dict:
    body = json.dumps({"task": task, "inputs": inputs}).encode()
    req = urllib.request.Request(server.url + "/v1/classify", data=body, headers={"content-type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _infer_body(inputs: list[dict]) -> bytes:
    return json.dumps({"inputs": inputs}).encode()


def _grpc_infer(texts: list[str]) -> v2.ModelInferRequest:
    msg = v2.ModelInferRequest(model_name="rte")
    msg.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    msg.raw_input_contents.append(bytes_tensor(texts))
    return msg


# --- traces and logs -------------------------------------------------------------------------------------------------


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, parent, f"00-{trace_id}-{parent}-01"


STAGES = ["ingress", "parse", "tokenize", "queue", "batch", "respond"]  # ingress: from HAProxy's stamp


def _check_trace(spans, parent: str, root_name: str) -> None:
    by_name = {s.name: s for s in spans}
    root = by_name[root_name]
    assert root.parent_id == parent  # the caller's span
    assert set(STAGES) | {"model"} <= set(by_name), sorted(by_name)
    for name in STAGES:
        assert by_name[name].parent_id == root.span_id
    assert by_name["model"].parent_id == by_name["batch"].span_id
    batch = by_name["batch"].attributes
    assert batch["fusionserve.batch.size"] >= 1 and batch["fusionserve.batch.tokens"] >= 1 and batch["fusionserve.revision"] == -1
    assert "rte" in batch["fusionserve.batch.tasks"]
    stages = sum(by_name[n].ms for n in STAGES)
    assert 0.9 * root.ms <= stages <= 1.02 * root.ms, (stages, root.ms)  # the stages tile the request


def test_a_trace_continues_the_callers_traceparent_over_http_and_grpc(server, receiver):
    trace_id, parent, traceparent = _traceparent()
    code, _, body = request(
        server.port, "POST", "/v2/models/rte/infer", _infer_body([_TEXT]), AUTH | {"traceparent": traceparent}
    )
    assert code == 200, body
    _check_trace(receiver.trace(trace_id, "POST /v2/models/rte/infer"), parent, "POST /v2/models/rte/infer")
    trace_id, parent, traceparent = _traceparent()
    server.stub.ModelInfer(_grpc_infer(["a fine film"]), metadata=(*GRPC_AUTH.items(), ("traceparent", traceparent)), timeout=60)
    name = "inference.GRPCInferenceService/ModelInfer"
    _check_trace(receiver.trace(trace_id, name), parent, name)


def test_the_root_span_starts_when_haproxy_got_the_request_and_a_forged_stamp_is_not_believed(server, receiver):
    """The request's headers go first, its body 400 ms later: HAProxy got the request's first byte when the headers
    came, the replica only once the body did (HAProxy waits for a body). The root span starts at HAProxy's instant,
    not at the replica's (it did on the code before, 400 ms later), and not at the instant the client forged in
    HAProxy's header (ten seconds earlier); the ``ingress`` span covers the wait, and the root ends before the
    client had the answer."""
    trace_id, _, traceparent = _traceparent()
    body = json.dumps({"task": "rte", "inputs": ["a fine film"]}).encode()
    forged = f"t={time.time_ns() // 1000 - 10_000_000} r=0 k={os.urandom(16).hex()}"
    head = (
        f"POST /v1/classify HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\ntraceparent: {traceparent}\r\n"
        f"content-type: application/json\r\n{INGRESS_HEADER}: {forged}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sent_ns = time.time_ns()
        sock.sendall(head.encode())
        time.sleep(0.4)
        sock.sendall(body)
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        assert answer.status == 200, answer.read()
        answer.read()
        answered_ns = time.time_ns()
    spans = {s.name: s for s in receiver.trace(trace_id, "POST /v1/classify")}
    root = spans["POST /v1/classify"]
    assert sent_ns - 2_000_000 <= root.start_ns <= sent_ns + 200_000_000, (root.start_ns - sent_ns) / 1e6
    assert root.end_ns <= answered_ns + 2_000_000, (root.end_ns - answered_ns) / 1e6
    ingress = spans["ingress"]  # up to the replica, which could not have the request before its body was sent
    assert ingress.start_ns == root.start_ns and ingress.end_ns >= sent_ns + 395_000_000, (ingress.end_ns - sent_ns) / 1e6
    assert spans["respond"].end_ns == root.end_ns  # the answer's serialisation and sending are in the trace


def test_oip_and_v1_classify_requests_share_a_batch(server, receiver):
    """Sent together while the model is idle, both wait in the same 300 ms window and run in one model call: the
    OIP request's batch span holds both requests' rows."""
    time.sleep(1.0)
    trace_id, _, traceparent = _traceparent()
    other = threading.Thread(target=_classify, args=(server, "nli", TEXTS))
    other.start()
    code, _, body = request(
        server.port, "POST", "/v2/models/rte/infer", _infer_body([_TEXT]), AUTH | {"traceparent": traceparent}
    )
    other.join()
    assert code == 200, body
    batch = next(s for s in receiver.trace(trace_id, "POST /v2/models/rte/infer") if s.name == "batch").attributes
    assert batch["fusionserve.batch.size"] == 2 + len(TEXTS) and set(batch["fusionserve.batch.tasks"]) == {"rte", "nli"}


def test_every_request_is_traced_and_log_lines_are_json_with_its_trace_id(server, receiver):
    trace_id, _, traceparent = _traceparent()
    code, _, _ = request(server.port, "POST", "/v1/classify", json.dumps({"task": "rte", "inputs": ["x"]}).encode(),
                         AUTH | {"traceparent": traceparent, "content-type": "application/json"})  # fmt: skip
    assert code == 200
    assert receiver.trace(trace_id, "POST /v1/classify")  # the other routes are traced too
    lines = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
    assert any(line["message"].startswith("serving ") for line in lines)  # the server's own lines
    found = []
    until = time.monotonic() + 20
    while not found and time.monotonic() < until:
        for path in Path("/tmp/ray").glob("session_*/logs/serve/replica_*.log"):
            text = path.read_text(errors="replace")
            if trace_id in text:
                found = [json.loads(line) for line in text.splitlines() if trace_id in line]
        time.sleep(0.5)
    assert found and all(line["trace_id"] == trace_id for line in found), "no replica log line with the trace id"
