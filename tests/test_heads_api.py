"""Heads beyond classification through the replica's classify path (serving/api/classify.py and its gRPC mapping),
without Ray or HTTP: a real ONNX Runtime session and scheduler on the tiny model with regression heads saved by the
real AdapterHub library. A regression task answers ``{"score": value}``, AdapterHub's value (it answered "LABEL_0, 1.0"
before); every input or option a task's head cannot take is a typed 4xx naming it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api.classify import Classifier, parse_fields, parse_json
from fusionserve.serving.api.grpc_ingress import request_fields, response_message
from fusionserve.serving.api.metrics import Metrics
from fusionserve.serving.api.schemas import HTTPError, Limits
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.scheduler.batching import BatchLimits, Scheduler
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.heads_helpers import HeadsModel, build_heads

TOL = 1e-4


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> HeadsModel:
    return build_heads(tmp_path_factory.mktemp("heads"))


@pytest.fixture(scope="module")
def core(heads) -> Classifier:
    runner = OnnxRunner(heads.artifact, threads=1, device="cpu")
    return Classifier(runner.encoder, Scheduler(runner, BatchLimits(max_batch_size=8)), Limits(max_inputs=16), Metrics())


def _classify(core: Classifier, body: dict) -> dict | HTTPError:
    async def read():
        return parse_fields(body)

    return asyncio.run(core(read, "test"))


def test_a_regression_head_answers_its_value_not_a_label(core, heads):
    texts = [SENTENCES[0], SENTENCES[1], list(PAIRS[0])]
    inputs = [t if isinstance(t, str) else {"text": t[0], "text_pair": t[1]} for t in texts]
    for task in ("sts", "sick"):
        want = heads.reference(task, [t if isinstance(t, str) else tuple(t) for t in texts])[:, 0]
        out = _classify(core, {"task": task, "inputs": inputs})
        assert not isinstance(out, HTTPError), out
        assert [set(p) for p in out["predictions"]] == [{"score", "truncated"}] * 3, out
        np.testing.assert_allclose([p["score"] for p in out["predictions"]], want, atol=TOL, rtol=0)
        raw = _classify(core, {"task": task, "inputs": inputs, "raw_scores": True})
        np.testing.assert_allclose([p["score"] for p in raw["predictions"]], want, atol=TOL, rtol=0)


def test_a_request_mixing_regression_and_classification_tasks(core, heads):
    out = _classify(core, {"tasks": ["sts", "rte"], "inputs": SENTENCES[:2]})
    sts, rte = out["results"]
    assert set(sts["predictions"][0]) == {"score", "truncated"}
    assert set(rte["predictions"][0]) == {"label", "score", "scores", "truncated"}
    np.testing.assert_allclose([p["score"] for p in sts["predictions"]], heads.reference("sts", SENTENCES[:2])[:, 0], atol=TOL)


def test_grpc_carries_the_value_in_score_with_no_label(core, heads):
    msg = pb.ClassifyRequest(task="sts", inputs=[pb.Input(text=SENTENCES[2])])
    out = _classify(core, request_fields(msg))
    reply = response_message(out)
    assert reply.predictions[0].label == "" and list(reply.labels) == [] and list(reply.predictions[0].scores) == []
    assert reply.predictions[0].score == pytest.approx(float(heads.reference("sts", [SENTENCES[2]])[0, 0]), abs=TOL)


@pytest.mark.parametrize(
    "body, status, kind, says",
    [
        ({"task": "sts", "inputs": [{"text": "a", "choices": ["x", "y"]}]}, 422, "invalid_input", "task 'sts' is regression"),
        ({"task": "rte", "inputs": [{"question": "who", "context": "the cat"}]}, 422, "invalid_input", "this one is a question"),
        (
            {"task": "rte", "inputs": [{"text": "a", "choices": ["x"]}]},
            422,
            "invalid_input",
            "holds 1 choice; a multiple-choice input needs 2 to 64",
        ),
        ({"task": "rte", "inputs": [{"question": "who"}]}, 422, "invalid_input", "missing field 'context'"),
        (
            {"task": "rte", "inputs": ["a"], "aggregation_strategy": "simple"},
            422,
            "invalid_option",
            "applies to tagging tasks only",
        ),
        ({"task": "rte", "inputs": ["a"], "aggregation_strategy": "biggest"}, 422, "invalid_option", "allowed: none, simple"),
        ({"task": "sts", "inputs": ["a"], "top_k": 2}, 422, "invalid_option", "top_k applies to question_answering tasks"),
        ({"task": "rte", "inputs": ["a"], "doc_stride": -1}, 422, "invalid_option", "doc_stride must be a whole number"),
        ({"task": "rte", "inputs": [{"text": "a", "choices": ["x", "y"]}] * 9}, 413, "too_many_inputs", "making 18 rows"),
    ],
)
def test_inputs_and_options_a_head_cannot_take_are_refused_by_name(core, body, status, kind, says):
    for fields in (body, request_fields(_message(body))):
        out = _classify(core, fields)
        assert isinstance(out, HTTPError) and (out.status, out.reason) == (status, kind), out
        assert says in out.message, out.message


def test_a_json_body_is_read_by_the_same_checks(core):
    for body, says in [
        (b'{"task": "rte", "inputs": [{"text": "a", "choices": ["only one"]}]}', "inputs[0]: 'choices' holds 1 choice"),
        (b'{"task": "rte", "inputs": ["b", {"text": "a", "choices": []}]}', "inputs[1]: 'choices' holds 0 choices"),
        (b'{"task": "rte", "inputs": [{"text": "a", "choices": ["x", ""]}]}', "'choices[1]' must be a non-empty string"),
        (b'{"task": "rte", "inputs": [{"question": "q", "context": " "}]}', "'context' must be a non-empty string"),
    ]:

        async def read(body=body):
            return parse_json(body)

        out = asyncio.run(core(read, "test"))
        assert isinstance(out, HTTPError) and (out.status, out.reason) == (422, "invalid_input"), out
        assert says in out.message, out.message


def _message(body: dict) -> pb.ClassifyRequest:
    """The gRPC request a client would send for the JSON ``body``."""
    inputs = []
    for i in body["inputs"]:
        if isinstance(i, str):
            inputs.append(pb.Input(text=i))
        else:
            inputs.append(pb.Input(**{k: v for k, v in i.items()}))
    options = {k: v for k, v in body.items() if k not in ("inputs",)}
    if options.get("doc_stride", 0) < 0:  # uint32 on the wire: a negative stride cannot be sent; the largest can
        options["doc_stride"] = 2**32 - 1
    return pb.ClassifyRequest(inputs=inputs, **options)
