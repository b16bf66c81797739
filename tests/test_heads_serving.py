"""Heads beyond classification on a real `fusionserve serve` (Ray Serve, ONNX Runtime, HAProxy) on 127.0.0.1, over
HTTP and gRPC, with the tiny model's heads saved by the real AdapterHub library: a regression task answers its value,
a multiple-choice task its choice, each equal to AdapterHub's; requests of every kind sent together are answered from
batches that mix them, each answer what it is alone; every bad input of a head is a typed 4xx (gRPC
INVALID_ARGUMENT with the error type in the trailer) and the server goes on serving.

The server waits up to 400 ms for a batch to fill (--batch-wait-ms 400): requests sent together share a batch."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc
from fusionserve.serving.api.grpc_ingress import ERROR_TYPE_KEY
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.heads_helpers import HeadsModel, build_heads
from tests.serving_helpers import call, free_port, launch, stop

pytestmark = pytest.mark.slow
TOL = 1e-4
METADATA = (("application", "fusionserve"),)
THREE = ["the cat sat", "a good film", "it is boring"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> HeadsModel:
    return build_heads(tmp_path_factory.mktemp("heads-serving"))


@pytest.fixture(scope="module")
def server(heads, tmp_path_factory):
    grpc_port = free_port()
    served = launch(heads.artifact, tmp_path_factory.mktemp("heads-log") / "server.log", "--grpc-port", str(grpc_port),
                    "--threads", "1", "--max-batch-size", "32", "--batch-wait-ms", "400", "--max-inputs", "16")  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    served.stub = pb_grpc.ClassifierStub(channel)
    yield served
    channel.close()
    stop(served)


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


def test_multiple_choice_answers_its_choice_over_http_and_grpc(server, heads):
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


def test_requests_of_every_kind_sent_together_share_batches_and_answer_as_alone(server):
    mc = {"text": SENTENCES[1], "choices": THREE}
    work = [
        {"task": "rte", "inputs": [SENTENCES[0], SENTENCES[3]]},
        {"task": "sts", "inputs": [SENTENCES[1]]},
        {"task": "swag", "inputs": [mc, {"text": SENTENCES[4], "choices": THREE[:2]}]},
        {"task": "sick", "inputs": [{"text": PAIRS[1][0], "text_pair": PAIRS[1][1]}]},
        {"tasks": ["sts", "alpha_only"], "inputs": [SENTENCES[2]]},
    ]
    alone = [_classify(server, body) for body in work]  # one at a time first
    assert all(status == 200 for status, _ in alone), alone
    before = _batches_of_tasks(server)
    with ThreadPoolExecutor(len(work)) as pool:
        together = list(pool.map(lambda body: _classify(server, body), work))
    after = _batches_of_tasks(server)
    for (status, got), (_, want), body in zip(together, alone, work, strict=True):
        assert status == 200, got
        for g, w in zip(got.get("results", [got]), want.get("results", [want]), strict=True):
            for p, q in zip(g["predictions"], w["predictions"], strict=True):
                assert p.get("label") == q.get("label") and p.get("choice") == q.get("choice"), (body, p, q)
                np.testing.assert_allclose(
                    p["score"] if "score" in p else p["scores"], q["score"] if "score" in q else q["scores"], atol=TOL
                )
    new = {le: after[le] - before.get(le, 0) for le in after}  # batches of the concurrent requests, by tasks held
    assert new[float("inf")] - new[2.0] >= 1, (before, after)  # at least one batch held 3 tasks or more


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
}  # fmt: skip


@pytest.mark.parametrize("body, status, kind, says", BAD.values(), ids=BAD.keys())
def test_bad_inputs_are_typed_4xx_over_http_and_grpc(server, body, status, kind, says):
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


def test_tasks_name_their_heads(server):
    status, body = call(f"{server.url}/v1/tasks")
    tasks = body["tasks"]
    assert status == 200 and body["max_choices"] == 64
    assert {n: t["head"] for n, t in tasks.items() if n in ("rte", "sts", "swag")} == {
        "rte": "classification", "sts": "regression", "swag": "multiple_choice",
    }  # fmt: skip
    assert tasks["swag"]["input"] == ["text", "choices"] and tasks["swag"]["num_choices"] == 3


def test_tei_routes_refuse_a_default_task_that_is_not_classification(heads):
    base = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(heads.artifact), "--print-config"]
    out = subprocess.run([*base, "--default-task", "sts"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "the default task 'sts' is regression" in out.stderr
    assert "use POST /v1/classify" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
