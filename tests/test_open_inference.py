"""End to end: the Open Inference Protocol (KServe v2, REST and gRPC) on a real `fusionserve serve` (Ray Serve, ONNX
Runtime, HAProxy) on 127.0.0.1, spoken to by Triton's own client (tritonclient 2.73 in an environment of its own:
tests/triton_env.py) and by raw requests for what no client sends (its traces: tests/test_tracing_server.py; its
OpenAPI description: tests/test_openapi_description.py). The server is conftest's ``oip_server``, shared with those two
(one group): an API key, gRPC, --log-format json, small limits (8 inputs, 8 KB bodies, batches of 8) and a 300 ms batch
wait (a lone request waits that long for company, which makes deadlines and mixed batches testable on any machine).
"""

import json
import time
import urllib.request

import grpc
import numpy as np
import pytest

from fusionserve.serving.api import grpc_predict_v2_pb2 as v2
from fusionserve.serving.api import grpc_predict_v2_pb2_grpc as v2_grpc
from fusionserve.serving.api.grpc_status import ERROR_TYPE_KEY
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.oip_helpers import Triton, bytes_tensor, request
from tests.serving_helpers import OIP_KEY as KEY
from tests.serving_helpers import OIP_MAX_BATCH, OIP_MAX_BODY, OIP_MAX_INPUTS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("oip_server")]

AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY = OIP_MAX_BODY
TEXTS = [SENTENCES[0], SENTENCES[2], SENTENCES[4]]
# a whole batch (OIP_MAX_BATCH) of texts, and of pairs: SENTENCES (5) and PAIRS (3); PAIRS and each sentence paired
# with the next
FULL_TEXTS = SENTENCES + [p[0] for p in PAIRS]
FULL_PAIRS = PAIRS + list(zip(SENTENCES, SENTENCES[1:] + SENTENCES[:1], strict=True))


@pytest.fixture
def server(oip_server):
    """conftest's OIP server, with its gRPC address (``grpc``), a channel to it (``channel``) and a stub (``stub``) of the
    inference service."""
    oip_server.grpc = f"127.0.0.1:{oip_server.grpc_port}"
    with grpc.insecure_channel(oip_server.grpc) as channel:
        oip_server.channel, oip_server.stub = channel, v2_grpc.GRPCInferenceServiceStub(channel)
        yield oip_server


@pytest.fixture(scope="module")
def triton():
    client = Triton()
    yield client
    client.close()


@pytest.fixture(scope="module")
def labels(artifact) -> dict[str, list[str]]:
    return {n: t["labels"] for n, t in json.loads((artifact / "manifest.json").read_text())["tasks"].items()}


def _url(server, client: str) -> str:
    return server.grpc if client.startswith("grpc") else f"127.0.0.1:{server.port}"


def _headers(client: str) -> dict[str, str]:
    return GRPC_AUTH if client.startswith("grpc") else AUTH


def _classify(server, task: str, inputs: list, **extra) -> dict:
    body = json.dumps({"task": task, "inputs": inputs, **extra}).encode()
    req = urllib.request.Request(server.url + "/v1/classify", data=body, headers={"content-type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def _infer(triton, server, client: str, task: str, texts: list[str], **extra) -> dict:
    return triton.ask(
        op="infer", client=client, url=_url(server, client), model=task, texts=texts, headers=_headers(client), **extra
    )


# --- the routes, through tritonclient -----------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["http", "grpc"])
def test_server_and_model_routes_answer_tritonclient(server, triton, labels, client):
    def call(method, *args, headers=None):
        return triton.ask(op="call", client=client, url=_url(server, client), method=method, args=list(args),
                          kwargs={"headers": headers if headers is not None else _headers(client)})  # fmt: skip

    assert call("is_server_live", headers={})["result"] is True  # the probes ask for no key
    assert call("is_server_ready", headers={})["result"] is True
    meta = call("get_server_metadata")["result"]
    assert meta["name"] == "fusionserve" and {"classification", "binary_tensor_data", "model_configuration"} <= set(
        meta["extensions"]
    )
    for task, names in labels.items():
        assert call("is_model_ready", task)["result"] is True
        assert call("is_model_ready", task, "1")["result"] is True and call("is_model_ready", task, "2")["result"] is False
        model = call("get_model_metadata", task)["result"]
        assert model["name"] == task and model["versions"] == ["1"]
        assert [(t["name"], t["datatype"]) for t in model["inputs"]] == [("text", "BYTES"), ("text_pair", "BYTES")]
        assert [(t["name"], t["datatype"]) for t in model["outputs"]] == [("label", "BYTES"), ("scores", "FP32")]
        config = call("get_model_config", task)["result"]
        config = config.get("config", config)  # gRPC answers {"config": ...}
        assert config["name"] == task and int(config["max_batch_size"]) == OIP_MAX_BATCH
        assert json.loads(config["parameters"]["labels"]["string_value"]) == names  # the columns of scores
        assert [int(d) for d in config["output"][1]["dims"]] == [len(names)]
        if client == "http":  # the REST metadata names the labels too
            assert model["parameters"]["labels"] == names
    unknown = call("get_model_metadata", "nope")
    assert "unknown model 'nope'" in unknown["error"] and unknown["status"] in ("404", "StatusCode.NOT_FOUND")
    assert call("is_model_ready", "nope")["result"] is False


@pytest.mark.parametrize(
    ("client", "binary"), [("http", True), ("http", False), ("grpc", True), ("http_aio", True), ("grpc_aio", True)]
)
def test_tritonclient_classifies_every_task_as_v1_classify_does(server, triton, labels, client, binary):
    # each request is one whole batch (OIP_MAX_BATCH inputs): the model runs it at once and alone, so the two routes'
    # scores are compared bit for bit, without waiting out the batch wait (300 ms) 2 x 3 times per task
    assert len(FULL_TEXTS) == len(FULL_PAIRS) == OIP_MAX_BATCH
    for task, names in labels.items():
        for rank, pairs in ((2, None), (1, None), (2, [p[1] for p in FULL_PAIRS])):
            texts = [p[0] for p in FULL_PAIRS] if pairs else FULL_TEXTS
            got = _infer(triton, server, client, task, texts, pairs=pairs, rank=rank, binary=binary,
                         outputs=[{"name": "label", "binary": binary}, {"name": "scores", "binary": binary}])  # fmt: skip
            assert "error" not in got, got
            inputs = [{"text": t, "text_pair": p} for t, p in zip(texts, pairs, strict=True)] if pairs else texts
            want = _classify(server, task, inputs)["predictions"]
            flat = np.array(got["outputs"]["label"]).reshape(-1).tolist()
            assert flat == [p["label"] for p in want], (task, client)
            assert np.array(got["outputs"]["label"]).shape == ((len(texts), 1) if rank == 2 else (len(texts),))
            scores = np.array(got["outputs"]["scores"], dtype=np.float32)
            np.testing.assert_array_equal(scores, np.array([[p["scores"][n] for n in names] for p in want], dtype=np.float32))
            assert got["response"]["model_version"] == "1"


@pytest.mark.parametrize("client", ["http", "grpc"])
def test_the_classification_extension_answers_the_top_k_as_score_index_label(server, triton, labels, client):
    names = labels["rte"]
    got = _infer(triton, server, client, "rte", TEXTS, outputs=[{"name": "scores", "class_count": 2}])
    want = _classify(server, "rte", TEXTS)["predictions"]
    for row, pred in zip(got["outputs"]["scores"], want, strict=True):
        top = sorted(((v, names.index(k), k) for k, v in pred["scores"].items()), key=lambda x: -x[0])[:2]
        assert row == [f"{np.float32(v):f}:{i}:{k}" for v, i, k in top]
    wide = _infer(triton, server, client, "rte", TEXTS[:1], outputs=[{"name": "scores", "class_count": 10}])
    assert len(wide["outputs"]["scores"][0]) == len(names)  # k past the labels: every label


def test_raw_scores_are_the_logits_of_v1_classify(server, triton, labels):
    for client in ("http", "grpc"):
        got = _infer(triton, server, client, "nli", TEXTS, parameters={"raw_scores": True})
        want = _classify(server, "nli", TEXTS, raw_scores=True)["predictions"]
        expected = np.array([[p["scores"][n] for n in labels["nli"]] for p in want], dtype=np.float32)
        np.testing.assert_array_equal(np.array(got["outputs"]["scores"], dtype=np.float32), expected)


@pytest.mark.parametrize("client", ["http", "grpc"])
def test_every_model_route_asks_for_the_key(server, triton, client):
    wrong = {"authorization": "Bearer nope"} if client == "grpc" else {"Authorization": "Bearer nope"}
    for headers in ({}, wrong):
        got = triton.ask(op="infer", client=client, url=_url(server, client), model="rte", texts=TEXTS, headers=headers)
        assert got["status"] in ("401", "StatusCode.UNAUTHENTICATED") and "API key" in got["error"], got
        for method, args in (("get_model_metadata", ["rte"]), ("get_model_config", ["rte"]), ("get_server_metadata", [])):
            got = triton.ask(
                op="call", client=client, url=_url(server, client), method=method, args=args, kwargs={"headers": headers}
            )
            assert got["status"] in ("401", "StatusCode.UNAUTHENTICATED"), (method, got)
            assert KEY not in json.dumps(got)


# --- bad input: the protocol's error, the right status and gRPC code, never a 500, never a hang ----------------------


def _infer_body(inputs: list[dict], **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


_TEXT = {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}
BAD_JSON = [
    ("wrong datatype", [{**_TEXT, "datatype": "INT32", "data": [1, 2]}], 400, "datatype 'INT32' is not served"),
    ("wrong shape", [{**_TEXT, "shape": [1, 2]}], 400, "shape [1, 2] is not served"),
    ("shape and data disagree", [{**_TEXT, "shape": [3]}], 400, "holds 3 element(s), the data has 2"),
    ("missing text", [{**_TEXT, "name": "text_pair"}], 400, "input 'text' is missing"),
    ("unknown input", [_TEXT, {**_TEXT, "name": "image"}], 400, "'image' is not an input"),
    ("empty text", [{**_TEXT, "data": ["a", " "]}], 400, "inputs[1]: must be a non-empty string"),
    (
        "too many inputs",
        [{**_TEXT, "shape": [OIP_MAX_INPUTS + 1], "data": ["a"] * (OIP_MAX_INPUTS + 1)}],
        413,
        f"{OIP_MAX_INPUTS + 1} inputs in one request; the limit is {OIP_MAX_INPUTS}",
    ),
]


@pytest.mark.parametrize(("what", "inputs", "status", "says"), BAD_JSON, ids=[b[0] for b in BAD_JSON])
def test_bad_json_input_is_the_protocols_error(server, what, inputs, status, says):
    code, headers, body = request(server.port, "POST", "/v2/models/rte/infer", _infer_body(inputs), AUTH)
    assert code == status and says in json.loads(body)["error"], (what, code, body)
    assert headers["content-type"] == "application/json" and headers["x-fusionserve-error-type"]


def _refused_count(port: int, status: int) -> float:
    """fusionserve_request_duration_seconds' count of requests answered ``status`` (every task label: a request refused
    while it is read has none, "-")."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fusionserve_request_duration_seconds_count{") and f'status="{status}"' in line
    )  # fmt: skip


def test_a_refusals_metric_has_the_status_the_protocol_answered(server):
    """The request-duration metric labels an OIP refusal with the 400 it answers, not the 422 /v1/classify answers."""
    before = _refused_count(server.port, 400), _refused_count(server.port, 422)
    empty = _infer_body([{**_TEXT, "data": ["a", " "]}])  # refused by the checks /v1/classify shares (its 422)
    code, _, _ = request(server.port, "POST", "/v2/models/rte/infer", empty, AUTH)
    assert code == 400
    after = _refused_count(server.port, 400), _refused_count(server.port, 422)
    assert after == (before[0] + 1, before[1]), (before, after)


def _binary(texts: list[str], size: int | None = None, header_length: int | None = None) -> tuple[bytes, dict[str, str]]:
    raw = bytes_tensor(texts)
    head = _infer_body([{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                         "parameters": {"binary_data_size": len(raw) if size is None else size}}])  # fmt: skip
    length = len(head) if header_length is None else header_length
    return head + raw, AUTH | {"Inference-Header-Content-Length": str(length), "content-type": "application/octet-stream"}


def test_binary_data_whose_length_disagrees_with_its_header_is_refused(server):
    good, headers = _binary(["a fine film", "the plot"])
    code, _, body = request(server.port, "POST", "/v2/models/rte/infer", good, headers)
    assert code == 200, body
    cut = (10).to_bytes(4, "little") + b"abc"  # an element of 10 bytes, 3 of them sent
    head = _infer_body([{"name": "text", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(cut)}}])
    cases = [
        (_binary(["a", "b"], size=40), "binary_data_size 40 but 10 byte(s) of binary data are left"),
        (_binary(["a", "b"], size=5), "5 byte(s) of binary data after the JSON header belong to no input"),
        (_binary(["a", "b"], header_length=10_000), "Inference-Header-Content-Length: '10000' is not a length within"),
        (
            (head + cut, AUTH | {"Inference-Header-Content-Length": str(len(head))}),
            "an element of 10 bytes at byte 0, but only 3",
        ),
    ]
    for (data, head), says in cases:
        code, _, body = request(server.port, "POST", "/v2/models/rte/infer", data, head)
        assert code == 400 and says in json.loads(body)["error"], (says, code, body)


def test_unknown_model_or_version_and_oversized_bodies_are_refused(server):
    body = _infer_body([_TEXT])
    for path, says in (("/v2/models/nope/infer", "unknown model 'nope'"), ("/v2/models/rte/versions/7/infer", "version '7'")):
        code, _, got = request(server.port, "POST", path, body, AUTH)
        assert code == 404 and says in json.loads(got)["error"], got
    big, headers = _binary(["x" * (MAX_BODY + 100)])
    code, _, got = request(server.port, "POST", "/v2/models/rte/infer", big, headers)
    assert code == 413 and f"the limit is {MAX_BODY}" in json.loads(got)["error"]
    code, _, got = request(server.port, "POST", "/v2/models/rte/infer", body, AUTH | {"content-type": "text/plain"})
    assert code == 415 and "Content-Type 'text/plain' is not supported" in json.loads(got)["error"]
    code, _, got = request(server.port, "POST", "/v2/models/rte/infer", b"{not json", AUTH)
    assert code == 400 and "not valid JSON" in json.loads(got)["error"]
    code, _, got = request(server.port, "GET", "/v2/models/rte/nope", None, AUTH)
    assert code == 404 and "error" in json.loads(got)


def _grpc_infer(texts: list[str], datatype: str = "BYTES", shape: list[int] | None = None, **fields) -> v2.ModelInferRequest:
    msg = v2.ModelInferRequest(model_name=fields.pop("model", "rte"), **fields)
    msg.inputs.add(name="text", datatype=datatype, shape=shape or [len(texts)])
    msg.raw_input_contents.append(bytes_tensor(texts))
    return msg


BAD_GRPC = [
    ("wrong datatype", _grpc_infer(["a"], datatype="FP32"), grpc.StatusCode.INVALID_ARGUMENT, "datatype 'FP32'"),
    ("wrong shape", _grpc_infer(["a"], shape=[1, 1, 1]), grpc.StatusCode.INVALID_ARGUMENT, "shape [1, 1, 1]"),
    ("missing text", v2.ModelInferRequest(model_name="rte"), grpc.StatusCode.INVALID_ARGUMENT, "input 'text' is missing"),
    ("unknown model", _grpc_infer(["a"], model="nope"), grpc.StatusCode.NOT_FOUND, "unknown model 'nope'"),
    ("unknown version", _grpc_infer(["a"], model_version="9"), grpc.StatusCode.NOT_FOUND, "version '9'"),
    ("oversized", _grpc_infer(["x" * (MAX_BODY + 100)]), grpc.StatusCode.INVALID_ARGUMENT, f"the limit is {MAX_BODY}"),
]


@pytest.mark.parametrize(("what", "message", "code", "says"), BAD_GRPC, ids=[b[0] for b in BAD_GRPC])
def test_bad_grpc_input_is_refused_with_its_code(server, what, message, code, says):
    with pytest.raises(grpc.RpcError) as err:
        server.stub.ModelInfer(message, metadata=tuple(GRPC_AUTH.items()), timeout=60)
    assert err.value.code() == code and says in err.value.details(), (what, err.value.details())
    assert dict(err.value.trailing_metadata())[ERROR_TYPE_KEY]


def test_bytes_that_are_not_the_message_and_cut_elements_are_refused(server):
    call = server.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as err:
        call(b"\xff\xff\xff", metadata=tuple(GRPC_AUTH.items()), timeout=60)
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid inference.ModelInferRequest" in err.value.details()
    )
    msg = _grpc_infer(["a fine film"])
    msg.raw_input_contents[0] = msg.raw_input_contents[0][:-2]
    with pytest.raises(grpc.RpcError) as err:
        server.stub.ModelInfer(msg, metadata=tuple(GRPC_AUTH.items()), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "only 9 byte(s) follow" in err.value.details()
    ok = server.stub.ModelInfer(_grpc_infer(["a fine film"]), metadata=tuple(GRPC_AUTH.items()), timeout=60)
    assert [o.name for o in ok.outputs] == ["label", "scores"]  # still serving


def test_a_request_still_queued_at_its_deadline_is_dropped(server, triton):
    for client in ("http", "grpc"):
        time.sleep(1.0)  # the model idle: a lone request waits 300 ms for a batch to fill
        got = _infer(triton, server, client, "rte", TEXTS[:1], timeout_us=50_000)
        assert got["status"] in ("504", "StatusCode.DEADLINE_EXCEEDED") and "it was not run" in got["error"], got
    time.sleep(1.0)
    got = _infer(triton, server, "grpc", "rte", TEXTS[:1], client_timeout=0.1)  # the call's own deadline
    assert got["status"] == "StatusCode.DEADLINE_EXCEEDED", got
