"""End to end, the API options on a real `fusionserve serve` (Ray Serve, ONNX Runtime, HAProxy) on 127.0.0.1 with an
API key given as --api-key (two: rotation), a default task and gRPC: every model route asks for the key over HTTP and gRPC and
the probes do not, the key shows nowhere; raw scores are the AdapterHub reference's logits; left truncation keeps the
last tokens; a request still queued at its deadline gets 504 and never reaches the model, and so does the request
of a client that hung up (counted apart); TEI's /predict and the Inference API's / answer in their shapes, and
huggingface_hub's InferenceClient classifies through them.

The server is conftest's ``keyed_server`` (serving_helpers.KEYED_ARGS), shared with test_serving_e2e: this module
runs first on it, in one group. It waits up to 1 s for a batch to fill (--batch-wait-ms 1000, --max-batch-size 4): a
request of fewer than 4 inputs reaching an idle model is still queued 1 s after it arrived, which is what lets a 50 ms
deadline pass, or a client hang up, while it waits, on any machine. (The wait ends early when another request arrives:
the tests that need it leave the model idle before each such request.)"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import jsonschema
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc
from fusionserve.serving.api.grpc_ingress import ERROR_TYPE_KEY
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.runtime_helpers import MAX_SEQ_LEN  # the shared artifact's
from tests.serving_helpers import KEY, OTHER_KEY, descendants

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("keyed_server")]

WRONG = ["", "Bearer", "Bearer " + "x" * len(KEY), "Bearer " + KEY[:-1], "Bearer " + KEY + "0", f"Basic {KEY}", KEY]
METADATA = (("application", "fusionserve"),)


@pytest.fixture
def server(keyed_server):
    """conftest's keyed server, with a gRPC stub (``stub``) of the Classifier service."""
    with grpc.insecure_channel(f"127.0.0.1:{keyed_server.grpc_port}") as channel:
        keyed_server.stub = pb_grpc.ClassifierStub(channel)
        yield keyed_server


def _call(url: str, body: object = None, auth: str | None = "Bearer " + KEY, headers: dict | None = None, method=None):
    """(status, parsed body, response headers)."""
    data = json.dumps(body).encode() if body is not None else None
    head = {"content-type": "application/json"} | ({"authorization": auth} if auth is not None else {}) | (headers or {})
    req = urllib.request.Request(url, data=data, headers=head, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null"), dict(resp.headers)
    except urllib.error.HTTPError as err:
        text = err.read()
        return err.code, json.loads(text) if text[:1] in (b"{", b"[") else {"raw": text.decode()}, dict(err.headers)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics (open without a key): (name, sorted labels) -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _computed(m: dict) -> float:
    """Inputs the model has run, every task."""
    return sum(v for (name, _), v in m.items() if name == "fusionserve_inputs_total")


def _dropped(m: dict, reason: str) -> float:
    return m.get(("fusionserve_dropped_requests_total", (("reason", reason),)), 0.0)


ROUTES = [
    ("/v1/classify", {"task": "rte", "inputs": ["x"]}),
    ("/v1/tasks", None),
    ("/predict", {"inputs": "x"}),
    ("/", {"inputs": "x"}),
    ("/no/such/route", None),
]


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_every_model_route_asks_for_the_key(server, path, body):
    for auth in [None, *WRONG]:
        status, got, headers = _call(server.url + path, body, auth=auth)
        assert status == 401, (path, auth, got)
        assert got["error"]["type"] == "unauthorized" and "Authorization: Bearer <key>" in got["error"]["message"]
        assert headers.get("www-authenticate", "").startswith("Bearer")
        assert KEY not in json.dumps(got)
    if path != "/no/such/route":
        for key in (KEY, OTHER_KEY):
            status, got, _ = _call(server.url + path, body, auth=f"Bearer {key}", headers={"x-request-timeout-ms": "60000"})
            assert status == 200, (path, got)


def test_probes_and_metrics_need_no_key(server):
    for path in ("/healthz", "/readyz", "/metrics", "/docs"):
        with urllib.request.urlopen(server.url + path, timeout=60) as resp:
            assert resp.status == 200, path


def _message(texts, **fields) -> pb.ClassifyRequest:
    return pb.ClassifyRequest(task="rte", inputs=[pb.Input(text=t) for t in texts], **fields)


def test_grpc_asks_for_the_key_too(server):
    for auth in [None, *WRONG[1:]]:
        metadata = METADATA + ((("authorization", auth),) if auth is not None else ())
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Classify(_message(["x"]), metadata=metadata, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, auth
        assert dict(err.value.trailing_metadata())[ERROR_TYPE_KEY] == "unauthorized" and KEY not in err.value.details()
    got = server.stub.Classify(_message(["x"] * 4), metadata=(*METADATA, ("authorization", f"Bearer {KEY}")), timeout=60)
    assert len(got.predictions) == 4


def _reference(built_st, task: str, batch: dict) -> np.ndarray:
    return built_st.reference_logits(task, {k: torch.as_tensor(v) for k, v in batch.items()}).numpy()


def test_raw_scores_are_the_reference_logits_over_http_and_grpc(server, built_st, local_labels):
    inputs = [*SENTENCES[:3], {"text": PAIRS[0][0], "text_pair": PAIRS[0][1]}, SENTENCES[0]]
    status, got, _ = _call(server.url + "/v1/classify", {"task": "rte", "inputs": inputs, "raw_scores": True})
    assert status == 200, got
    labels = local_labels["rte"]
    raw = np.array([[p["scores"][lab] for lab in labels] for p in got["predictions"]])
    singles = built_st.tokenizer(SENTENCES[:3], padding=True, return_tensors="np")
    pair = built_st.tokenizer([PAIRS[0][0]], [PAIRS[0][1]], return_tensors="np")
    want = np.concatenate([_reference(built_st, "rte", dict(singles)), _reference(built_st, "rte", dict(pair))])
    np.testing.assert_allclose(raw[:4], want, atol=1e-4)
    assert [p["score"] for p in got["predictions"]] == [max(r) for r in raw.tolist()]
    assert raw[0].tolist() == raw[4].tolist() and any(abs(v - round(v, 6)) > 0 for v in raw.ravel())  # unrounded
    msg = pb.ClassifyRequest(task="rte", inputs=[pb.Input(text=t) for t in SENTENCES[:3]], raw_scores=True)
    reply = server.stub.Classify(msg, metadata=(*METADATA, ("authorization", f"Bearer {KEY}")), timeout=60)
    np.testing.assert_allclose([list(p.scores) for p in reply.predictions], want[:3], atol=1e-4)


@pytest.fixture(scope="module")
def local_labels(artifact) -> dict:
    return {n: t["labels"] for n, t in json.loads((artifact / "manifest.json").read_text())["tasks"].items()}


def test_left_truncation_keeps_the_last_tokens(server, built_st, local_labels):
    text = " ".join(SENTENCES)
    tok = built_st.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > MAX_SEQ_LEN
    kept = {"left": ids[-(MAX_SEQ_LEN - 2) :], "right": ids[: MAX_SEQ_LEN - 2]}
    labels = local_labels["rte"]
    for direction, body_ids in kept.items():
        status, got, _ = _call(server.url + "/v1/classify",
                               {"task": "rte", "inputs": [text], "raw_scores": True, "truncation_direction": direction})  # fmt: skip
        assert status == 200, got
        assert got["predictions"][0]["truncated"] is True
        row = [tok.cls_token_id, *body_ids, tok.sep_token_id]
        batch = {"input_ids": [row], "attention_mask": [[1] * len(row)], "token_type_ids": [[0] * len(row)]}
        want = _reference(built_st, "rte", batch)[0]
        np.testing.assert_allclose([got["predictions"][0]["scores"][lab] for lab in labels], want, atol=1e-4, err_msg=direction)


def _idle() -> None:
    """Long enough for the model thread to end its batch wait (1 s) and wait idle for the next request."""
    time.sleep(2.0)


def test_a_request_still_queued_at_its_deadline_gets_504_and_never_reaches_the_model(server):
    before = _metrics(server.url)
    for how in ({"timeout_ms": 50}, {"header": "50"}):
        _idle()
        body = {"task": "rte", "inputs": ["deadline"] * 2} | ({"timeout_ms": 50} if "timeout_ms" in how else {})
        status, got, _ = _call(server.url + "/v1/classify", body,
                               headers={"x-request-timeout-ms": how["header"]} if "header" in how else None)  # fmt: skip
        assert status == 504 and got["error"]["type"] == "deadline_exceeded", got
        assert "it was not run" in got["error"]["message"]
    _idle()
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Classify(
            _message(["deadline"], timeout_ms=50), metadata=(*METADATA, ("authorization", f"Bearer {KEY}")), timeout=60
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _idle()
    status, got, _ = _call(server.url + "/predict", {"inputs": "deadline", "timeout_ms": 50})
    assert status == 504, got
    time.sleep(1.5)  # past the batch wait: a row that had stayed queued would have run by now
    after = _metrics(server.url)
    assert _computed(after) == _computed(before)  # none of the 5 inputs reached the model
    assert _dropped(after, "deadline_exceeded") - _dropped(before, "deadline_exceeded") == 4
    assert after[("fusionserve_request_duration_seconds_count", (("status", "504"), ("task", "rte")))] >= 4


def test_a_grpc_call_still_queued_at_its_own_deadline_is_dropped_as_past_its_deadline(server):
    """The call's own deadline (the client's timeout; no timeout_ms) is the request's: dropped before the model and
    counted as deadline_exceeded, not as a caller gone (what gRPC's cancellation at the deadline made of it).

    The call must reach the queue within its 0.5 s to be dropped there: on a loaded machine it has been seen not to (no
    count moved at all, the call cancelled on its way to the replica). Such a try says nothing either way and is made
    again, at most three times; a try that reached the queue decides."""
    for _ in range(3):
        before = _metrics(server.url)
        _idle()
        with pytest.raises(grpc.RpcError) as err:  # one input waits for its batch to fill (1 s): longer than its 0.5 s
            server.stub.Classify(_message(["deadline"]), metadata=(*METADATA, ("authorization", f"Bearer {KEY}")), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(1.5)  # past the batch wait: a row that had stayed queued would have run by now
        after = _metrics(server.url)
        assert _computed(after) == _computed(before)
        moved = {r: _dropped(after, r) - _dropped(before, r) for r in ("deadline_exceeded", "client_disconnected")}
        if any(moved.values()):
            break
    assert moved == {"deadline_exceeded": 1, "client_disconnected": 0}, moved


def test_a_client_that_hangs_up_is_dropped_before_the_model_and_counted_apart(server):
    before = _metrics(server.url)
    _idle()
    body = json.dumps({"task": "rte", "inputs": ["hang up"] * 3}).encode()
    head = (f"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + body)
        time.sleep(0.2)  # the request has reached the replica and waits for its batch to fill
    deadline = time.monotonic() + 30
    while _dropped(_metrics(server.url), "client_disconnected") == _dropped(before, "client_disconnected"):
        assert time.monotonic() < deadline, "the hang-up was not counted"
        time.sleep(0.2)
    time.sleep(1.5)  # past the batch wait
    after = _metrics(server.url)
    assert _computed(after) == _computed(before)
    assert _dropped(after, "client_disconnected") - _dropped(before, "client_disconnected") == 1
    assert ("fusionserve_request_duration_seconds_count", (("status", "200"), ("task", "rte"))) in after
    assert after.get(("fusionserve_request_duration_seconds_count", (("status", "499"), ("task", "rte")))) >= 1


# TEI's /predict as its OpenAPI description (version 1.6.0, docs/openapi.json of text-embeddings-inference) defines
# it, restated here: PredictRequest {inputs: PredictInput, raw_scores, truncate, truncation_direction Left|Right};
# PredictInput: a text, a pair (exactly two texts) or a batch of [text] / [text, text_pair] items; PredictResponse:
# a list of Prediction {label, score}, or a list of such lists.
_TEXTS = {"type": "array", "items": {"type": "string"}}
_PREDICTIONS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["label", "score"],
        "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
    },
}
TEI_PREDICT_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "inputs": {
            "oneOf": [
                {"type": "string"},
                {**_TEXTS, "minItems": 2, "maxItems": 2},
                {"type": "array", "items": {"oneOf": [{**_TEXTS, "minItems": n, "maxItems": n} for n in (1, 2)]}},
            ]
        },
        "raw_scores": {"type": "boolean"},
        "truncate": {"type": ["boolean", "null"]},
        "truncation_direction": {"enum": ["Left", "Right"]},
    },
}
TEI_PREDICT_RESPONSE = {"oneOf": [_PREDICTIONS, {"type": "array", "items": _PREDICTIONS}]}


def _tei(server, body: dict) -> tuple[int, object]:
    """POST /predict with a body TEI's description accepts; a 200's answer is checked against its PredictResponse."""
    jsonschema.validate(body, TEI_PREDICT_REQUEST)
    status, got, _ = _call(server.url + "/predict", body)
    if status == 200:
        jsonschema.validate(got, TEI_PREDICT_RESPONSE)
    return status, got


def test_tei_predict_answers_in_tei_shapes(server, local_labels):
    labels = local_labels["rte"]
    status, ref, _ = _call(
        server.url + "/v1/classify", {"task": "rte", "inputs": [SENTENCES[0], {"text": "a b", "text_pair": "c"}]}
    )
    assert status == 200
    status, single = _tei(server, {"inputs": SENTENCES[0]})
    assert status == 200 and isinstance(single, list) and [set(p) for p in single] == [{"label", "score"}] * len(labels)
    assert sorted(p["label"] for p in single) == sorted(labels)
    assert [p["score"] for p in single] == sorted((p["score"] for p in single), reverse=True)
    assert {p["label"]: p["score"] for p in single} == ref["predictions"][0]["scores"]
    status, pair = _tei(server, {"inputs": ["a b", "c"]})  # two texts: one pair, as in TEI
    assert status == 200 and {p["label"]: p["score"] for p in pair} == ref["predictions"][1]["scores"]
    status, batch = _tei(server, {"inputs": [[SENTENCES[0]], ["a b", "c"], [SENTENCES[0]]]})  # TEI's batch items
    assert status == 200 and len(batch) == 3 and batch[0] == single and batch[1] == pair
    status, mixed, _ = _call(server.url + "/predict", {"inputs": [SENTENCES[0], ["a b", "c"]]})  # bare texts too
    assert status == 200 and mixed == batch[:2]
    status, raw = _tei(server, {"inputs": SENTENCES[0], "raw_scores": True, "truncation_direction": "Left"})
    assert status == 200 and sum(p["score"] for p in raw) != pytest.approx(1.0)
    status, refused = _tei(server, {"inputs": " ".join(SENTENCES), "truncate": False})
    assert status == 413 and refused["error"]["type"] == "too_many_tokens"


_CLIENT = """
import json, sys
from huggingface_hub import InferenceClient
try:
    got = InferenceClient(sys.argv[1], token=sys.argv[2]).text_classification(sys.argv[3])
    print(json.dumps([[e.label, e.score] for e in got]))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def _inference_client(url: str, token: str, text: str):
    """huggingface_hub's InferenceClient, unchanged, in a process of its own: HF_HUB_OFFLINE (set for the tests)
    makes it refuse every URL, loopback included."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", _CLIENT, url, token, text], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_inference_api_route_and_a_real_client(server, local_labels):
    labels = local_labels["rte"]
    status, nested, _ = _call(server.url + "/", {"inputs": SENTENCES[1], "parameters": {"top_k": 2}})
    assert status == 200 and len(nested) == 1 and len(nested[0]) == 2
    status, ref, _ = _call(server.url + "/v1/classify", {"task": "rte", "inputs": [SENTENCES[1]]})
    got = _inference_client(server.url, KEY, SENTENCES[1])
    assert sorted(label for label, _ in got) == sorted(labels)
    assert dict(got) == pytest.approx(ref["predictions"][0]["scores"], abs=1e-6)
    assert got[0][0] == ref["predictions"][0]["label"]  # highest first
    assert "401" in _inference_client(server.url, "not-the-key", SENTENCES[1])["error"]


def _ray_logs(pid: int) -> list[Path]:
    """The log files of the Ray session the server ``pid`` started (named in its raylet's command line)."""
    for child in descendants(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in argv:
            if arg.startswith("--session_dir="):
                return [p for p in Path(arg.split("=", 1)[1], "logs").rglob("*") if p.is_file()]
    raise AssertionError("no Ray session below the server")


def test_the_key_is_in_no_log_line_and_not_in_the_command_line(server):
    """Last in the module: every route above was called, with and without the key. --api-key is blanked out of the
    server's command line (what ps shows, and what Ray records as the job's entrypoint) before Ray starts."""
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in cmdline and b"<hidden>" in cmdline
    files = [server.log, *_ray_logs(server.proc.pid)]
    assert len(files) > 10
    found = [str(p) for p in files if KEY.encode() in p.read_bytes() or OTHER_KEY.encode() in p.read_bytes()]
    assert not found
