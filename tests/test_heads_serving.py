"""Heads beyond classification on a real `fusionserve serve` (Ray Serve, ONNX Runtime, HAProxy) on 127.0.0.1, over
HTTP and gRPC, with the tiny model's heads saved by the real AdapterHub library, exported live without the multiple-
choice task: `fusionserve tasks add` adds that task while the server runs, and every replica serves it; a regression
task answers its value and a multiple-choice task its choice, each equal to AdapterHub's; a tagging task's entities
and a QA task's answers equal the Hugging Face pipelines' on AdapterHub's model; a request for tasks of three heads
runs them in one batch, and requests of every kind sent together answer what they answer alone; every bad input of a
head is a typed 4xx (gRPC INVALID_ARGUMENT with the error type in the trailer) and the server goes on serving.

The server waits up to 400 ms for a batch to fill (--batch-wait-ms 400): a request that arrives meanwhile joins it."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusionserve.cli.main import main
from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc
from fusionserve.serving.api import grpc_predict_v2_pb2 as v2
from fusionserve.serving.api import grpc_predict_v2_pb2_grpc as v2_grpc
from fusionserve.serving.api.grpc_ingress import ERROR_TYPE_KEY
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.heads_helpers import HeadsModel, build_heads
from tests.oip_helpers import bytes_tensor, request
from tests.serving_helpers import call, free_port, launch, stop

pytestmark = pytest.mark.slow
TOL = 1e-4
METADATA = (("application", "fusionserve"),)
THREE = ["the cat sat", "a good film", "it is boring"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> HeadsModel:
    return build_heads(tmp_path_factory.mktemp("heads-serving"), live=True, leave_out=("swag",))


@pytest.fixture(scope="module")
def server(heads, tmp_path_factory):
    grpc_port = free_port()
    served = launch(heads.artifact, tmp_path_factory.mktemp("heads-log") / "server.log", "--grpc-port", str(grpc_port),
                    "--threads", "1", "--max-batch-size", "32", "--batch-wait-ms", "400", "--max-inputs", "16")  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    served.stub = pb_grpc.ClassifierStub(channel)
    served.oip = v2_grpc.GRPCInferenceServiceStub(channel)  # the Open Inference Protocol's service, on the same port
    yield served
    channel.close()
    stop(served)


@pytest.fixture(scope="module")
def swag_added(server, heads) -> tuple[int, int]:
    """`fusionserve tasks add` of the multiple-choice task while the server runs; (revision before, after) once every
    replica serves it."""
    before = call(f"{server.url}/v1/tasks")[1]
    assert "swag" not in before["tasks"]
    root = heads.spec.parent
    assert (
        main(
            [
                "tasks",
                "add",
                str(heads.artifact),
                "swag",
                "--fusion",
                str(root / "fusions/swag"),
                "--head",
                str(root / "heads/swag"),
            ]
        )
        == 0
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = call(f"{server.url}/v1/tasks")[1]
        if "swag" in now["tasks"]:
            return before["revision"], now["revision"]
        time.sleep(0.2)
    raise AssertionError("the added task was not served within 60 s")


def _classify(server, body: dict) -> tuple[int, dict]:
    return call(f"{server.url}/v1/classify", body)


def _batches_of_tasks(server) -> dict[float, float]:
    """The fusionserve_batch_tasks histogram: upper bound (tasks in a batch) -> batches so far with at most that many."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        families = text_string_to_metric_families(resp.read().decode())
    for family in families:
        if family.name == "fusionserve_batch_tasks":
            return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    raise AssertionError("no fusionserve_batch_tasks metric")


def test_regression_answers_its_value_over_http_and_grpc(server, heads):
    texts = [SENTENCES[0], PAIRS[0]]
    inputs = [texts[0], {"text": PAIRS[0][0], "text_pair": PAIRS[0][1]}]
    status, body = _classify(server, {"task": "sts", "inputs": inputs})
    assert status == 200, body
    want = heads.reference("sts", texts)[:, 0]
    assert [set(p) for p in body["predictions"]] == [{"score", "truncated"}] * 2, body  # no "LABEL_0", no 1.0
    np.testing.assert_allclose([p["score"] for p in body["predictions"]], want, atol=TOL)
    reply = server.stub.Classify(pb.ClassifyRequest(task="sts", inputs=[pb.Input(text=texts[0])]), metadata=METADATA, timeout=60)
    assert reply.predictions[0].label == "" and reply.predictions[0].score == pytest.approx(float(want[0]), abs=TOL)


def test_tasks_add_of_a_multiple_choice_head_on_the_running_server(server, swag_added):
    before, after = swag_added
    assert after == before + 1
    about = call(f"{server.url}/v1/tasks")[1]["tasks"]["swag"]
    assert (about["head"], about["num_choices"], about["input"]) == ("multiple_choice", 3, ["text", "choices"])


def test_multiple_choice_answers_its_choice_over_http_and_grpc(server, heads, swag_added):
    want = heads.reference("swag", [(SENTENCES[2], THREE)])[0]
    status, body = _classify(server, {"task": "swag", "inputs": [{"text": SENTENCES[2], "choices": THREE}]})
    assert status == 200, body
    pred = body["predictions"][0]
    assert pred["choice"] == int(np.argmax(want)) and pred["label"] == THREE[pred["choice"]]
    np.testing.assert_allclose(pred["scores"], np.exp(want) / np.exp(want).sum(), atol=TOL)
    msg = pb.ClassifyRequest(task="swag", inputs=[pb.Input(text=SENTENCES[2], choices=THREE)], raw_scores=True)
    reply = server.stub.Classify(msg, metadata=METADATA, timeout=60)
    assert reply.predictions[0].choice == pred["choice"]
    np.testing.assert_allclose(list(reply.predictions[0].scores), want, atol=TOL)


TAGGED = [SENTENCES[1], "the dog sat on a mat and the cat is not boring"]
QUESTION = {"question": "what is not very fun", "context": " ".join(SENTENCES)}  # read in several windows


@pytest.mark.parametrize("strategy", ["none", "simple", "first"])
def test_tagging_answers_the_pipelines_entities_over_http_and_grpc(server, heads, strategy):
    nlp = heads.pipeline("ner")
    status, body = _classify(server, {"task": "ner", "inputs": TAGGED, "aggregation_strategy": strategy})
    assert status == 200, body
    key = "tokens" if strategy == "none" else "entities"
    msg = pb.ClassifyRequest(task="ner", inputs=[pb.Input(text=t) for t in TAGGED], aggregation_strategy=strategy)
    reply = server.stub.Classify(msg, metadata=METADATA, timeout=60)
    for pred, grpc_pred, text in zip(body["predictions"], reply.predictions, TAGGED, strict=True):
        theirs = nlp(text, aggregation_strategy=strategy)
        over_grpc = getattr(grpc_pred, key)
        assert len(pred[key]) == len(theirs) == len(over_grpc) and theirs, (pred, theirs)
        for ours, by_grpc, want in zip(pred[key], over_grpc, theirs, strict=True):
            assert {k: v for k, v in ours.items() if k != "score"} == {k: v for k, v in want.items() if k != "score"}
            assert ours["score"] == pytest.approx(float(want["score"]), abs=1e-5) == by_grpc.score
            assert all(getattr(by_grpc, k) == v for k, v in ours.items() if k != "score")


def test_question_answering_answers_the_pipelines_answers_over_http_and_grpc(server, heads):
    theirs = heads.pipeline("squad")(**QUESTION, top_k=2, max_seq_len=32)
    status, body = _classify(server, {"task": "squad", "inputs": [QUESTION], "top_k": 2})
    assert status == 200, body
    ours = body["predictions"][0]
    assert [(a["answer"], a["start"], a["end"]) for a in ours] == [(a["answer"], a["start"], a["end"]) for a in theirs]
    np.testing.assert_allclose([a["score"] for a in ours], [a["score"] for a in theirs], atol=1e-5)
    msg = pb.ClassifyRequest(task="squad", inputs=[pb.Input(**QUESTION)], top_k=2)
    reply = server.stub.Classify(msg, metadata=METADATA, timeout=60)
    assert [(a.answer, a.score, a.start, a.end) for a in reply.predictions[0].answers] == [tuple(a.values()) for a in ours]


def test_requests_of_every_kind_sent_together_share_batches_and_answer_as_alone(server, swag_added):
    mc = {"text": SENTENCES[1], "choices": THREE}
    work = [
        {"tasks": ["rte", "sts", "ner"], "inputs": [SENTENCES[0], SENTENCES[3]]},  # three heads: its rows in one batch
        {"task": "swag", "inputs": [mc, {"text": SENTENCES[4], "choices": THREE[:2]}]},
        {"task": "squad", "inputs": [QUESTION]},
        {"task": "sick", "inputs": [{"text": PAIRS[1][0], "text_pair": PAIRS[1][1]}]},
        {"tasks": ["sts", "alpha_only"], "inputs": [SENTENCES[2]]},
    ]
    alone = [_classify(server, body) for body in work]  # one at a time first
    assert all(status == 200 for status, _ in alone), alone
    before = _batches_of_tasks(server)
    with ThreadPoolExecutor(len(work)) as pool:
        together = list(pool.map(lambda body: _classify(server, body), work))
    after = _batches_of_tasks(server)
    for (status, got), (_, want) in zip(together, alone, strict=True):
        assert status == 200, got
        _same(got, want)
    new = {le: after[le] - before.get(le, 0) for le in after}  # batches of the concurrent requests, by tasks held
    assert new[float("inf")] - new[2.0] >= 1, (before, after)  # at least one batch held 3 tasks or more


def _same(a: object, b: object) -> None:
    """Equal answers: the same structure, strings and integers; floats within TOL."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (a, b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (a, b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, abs=TOL)
    else:
        assert a == b


BAD = {  # what is sent -> (HTTP status, error type, what the message says)
    "one choice": ({"task": "swag", "inputs": [{"text": "a", "choices": ["x"]}]}, 422, "invalid_input", "holds 1 choice"),
    "no choices": ({"task": "swag", "inputs": ["a"]}, 422, "invalid_input", "without 'choices'"),
    "no context": ({"task": "rte", "inputs": [{"question": "who"}]}, 422, "invalid_input", "missing field 'context'"),
    "strategy on regression": (
        {"task": "sts", "inputs": ["a"], "aggregation_strategy": "simple"}, 422, "invalid_option",
        "aggregation_strategy applies to tagging tasks only",
    ),
    "unknown strategy": (
        {"task": "rte", "inputs": ["a"], "aggregation_strategy": "maximal"}, 422, "invalid_option", "is not known",
    ),
    "choices over the limit": ({"task": "swag", "inputs": [{"text": "a", "choices": ["x"] * 17}]}, 413, "too_many_inputs", "17 rows"),
    "a pair to tag": ({"task": "ner", "inputs": [{"text": "a", "text_pair": "b"}]}, 422, "invalid_input", "it tags one text"),
    "raw scores of QA": (
        {"task": "squad", "inputs": [QUESTION], "raw_scores": True}, 422, "invalid_option", "raw_scores: task 'squad'",
    ),
    "windows over the limit": (
        {"task": "squad", "inputs": [{"question": "who", "context": " ".join(SENTENCES * 12)}]}, 413, "too_many_inputs",
        "inputs[0] makes 37",
    ),
}  # fmt: skip


@pytest.mark.parametrize("body, status, kind, says", BAD.values(), ids=BAD.keys())
def test_bad_inputs_are_typed_4xx_over_http_and_grpc(server, swag_added, body, status, kind, says):
    got, answer = _classify(server, body)
    assert (got, answer["error"]["type"]) == (status, kind) and says in answer["error"]["message"], answer
    inputs = [pb.Input(text=i) if isinstance(i, str) else pb.Input(**i) for i in body["inputs"]]
    msg = pb.ClassifyRequest(**{k: v for k, v in body.items() if k != "inputs"}, inputs=inputs)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Classify(msg, metadata=METADATA, timeout=60)
    trailer = dict(err.value.trailing_metadata())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and trailer[ERROR_TYPE_KEY] == kind, err.value
    assert says in err.value.details()
    assert _classify(server, {"task": "sts", "inputs": ["still serving"]})[0] == 200


def test_tasks_name_their_heads(server, swag_added):
    status, body = call(f"{server.url}/v1/tasks")
    tasks = body["tasks"]
    assert status == 200 and body["max_choices"] == 64
    assert {n: t["head"] for n, t in tasks.items() if n in ("rte", "sts", "swag", "ner", "squad")} == {
        "rte": "classification", "sts": "regression", "swag": "multiple_choice", "ner": "tagging",
        "squad": "question_answering",
    }  # fmt: skip
    assert tasks["ner"]["options"] == ["aggregation_strategy"] and tasks["squad"]["input"] == ["question", "context"]


def test_tei_routes_refuse_a_default_task_that_is_not_classification(heads, capsys):
    """The command's refusal (`serve --print-config` starts nothing: run in this process, as its own would run it)."""
    code = main(["serve", str(heads.artifact), "--print-config", "--default-task", "sts"])
    err = capsys.readouterr().err
    assert code == 2 and "the default task 'sts' is regression" in err
    assert "use POST /v1/classify" in err and len(err.strip().splitlines()) == 1, err


def test_open_inference_protocol_refuses_tasks_whose_head_is_not_classification(server):
    """The Open Inference Protocol answers ``label`` and ``scores``: a regression or a tagging task is refused by name
    (400 / INVALID_ARGUMENT, type ``unsupported_task``, pointing at /v1/classify) for inference, metadata and
    configuration, and is not ready, over HTTP and gRPC; a classification task of the same artifact is served."""
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCES[0]]}]}).encode()
    for task, kind in (("sts", "regression"), ("ner", "tagging")):
        says = f"model '{task}' is a {kind} task; the Open Inference Protocol serves classification tasks only"
        for method, path in (("POST", "infer"), ("GET", ""), ("GET", "config"), ("GET", "ready")):
            url = f"/v2/models/{task}/{path}".rstrip("/")
            status, headers, got = request(server.port, method, url, body if method == "POST" else None)
            assert (status, headers["x-fusionserve-error-type"]) == (400, "unsupported_task"), (url, status, got)
            assert says in json.loads(got)["error"] and "use POST /v1/classify" in json.loads(got)["error"], got
        msg = v2.ModelInferRequest(model_name=task)
        msg.inputs.add(name="text", datatype="BYTES", shape=[1])
        msg.raw_input_contents.append(bytes_tensor([SENTENCES[0]]))
        for rpc, req in ((server.oip.ModelInfer, msg), (server.oip.ModelMetadata, v2.ModelMetadataRequest(name=task))):
            with pytest.raises(grpc.RpcError) as err:
                rpc(req, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details(), err.value
            assert dict(err.value.trailing_metadata())[ERROR_TYPE_KEY] == "unsupported_task"
        assert not server.oip.ModelReady(v2.ModelReadyRequest(name=task), timeout=60).ready
    # the classification task beside them is served as ever
    assert server.oip.ModelReady(v2.ModelReadyRequest(name="rte"), timeout=60).ready
    status, _, got = request(server.port, "POST", "/v2/models/rte/infer", body)
    assert status == 200 and [o["name"] for o in json.loads(got)["outputs"]] == ["label", "scores"], got
    meta = server.oip.ModelMetadata(v2.ModelMetadataRequest(name="rte"), timeout=60)
    assert [t.name for t in meta.outputs] == ["label", "scores"]
