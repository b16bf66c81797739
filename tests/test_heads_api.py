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
from fusionserve.serving.model.predictions import TextInput
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


MC = {"text": "a", "choices": ["x", "y"]}
REFUSED = {  # what is sent -> (status, error type, what the message says)
    "choices for regression": ({"task": "sts", "inputs": [MC]}, 422, "invalid_input", "task 'sts' is regression"),
    "question for classification": (
        {"task": "rte", "inputs": [{"question": "who", "context": "the cat"}]}, 422, "invalid_input", "this one is a question",
    ),
    "one choice": (
        {"task": "swag", "inputs": [{"text": "a", "choices": ["x"]}]}, 422, "invalid_input",
        "inputs[0]: 'choices' holds 1 choice; a multiple-choice input needs 2 to 64",
    ),
    "no choices": (
        {"task": "swag", "inputs": [MC] * 7 + ["a context"]}, 422, "invalid_input",
        "inputs[7]: task 'swag' is multiple_choice: an input is {\"text\": context, \"choices\": [...]}; this one is a text "
        "or a pair, without 'choices'",
    ),
    "choices for a second task": ({"tasks": ["swag", "rte"], "inputs": [MC]}, 422, "invalid_input", "task 'rte' is classification"),
    "no context": ({"task": "rte", "inputs": [{"question": "who"}]}, 422, "invalid_input", "missing field 'context'"),
    "strategy without tagging": (
        {"task": "swag", "inputs": [MC], "aggregation_strategy": "simple"}, 422, "invalid_option",
        "aggregation_strategy applies to tagging tasks only; 'swag' is multiple_choice",
    ),
    "unknown strategy": (
        {"task": "rte", "inputs": ["a"], "aggregation_strategy": "biggest"}, 422, "invalid_option",
        "aggregation_strategy 'biggest' is not known; allowed: none, simple, first, average, max",
    ),
    "top_k without QA": ({"task": "sts", "inputs": ["a"], "top_k": 2}, 422, "invalid_option", "top_k applies to question_answering"),
    "bad stride": ({"task": "rte", "inputs": ["a"], "doc_stride": -1}, 422, "invalid_option", "doc_stride must be a whole number"),
    "rows over the limit": ({"task": "swag", "inputs": [MC] * 9}, 413, "too_many_inputs", "making 18 rows"),
}  # fmt: skip


@pytest.mark.parametrize("body, status, kind, says", REFUSED.values(), ids=REFUSED.keys())
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


def test_a_multiple_choice_head_softmaxes_over_any_number_of_choices(core, heads):
    context = SENTENCES[1]
    three = ["the cat sat", "a good film", "it is boring"]
    want = heads.reference("swag", [(context, three)])[0]  # AdapterHub's MultipleChoiceHead: (1, 3)
    out = _classify(core, {"task": "swag", "inputs": [{"text": context, "choices": three}]})
    pred = out["predictions"][0]
    assert set(pred) == {"label", "choice", "scores", "truncated"} and pred["choice"] == int(np.argmax(want)), pred
    assert pred["label"] == three[pred["choice"]]
    np.testing.assert_allclose(pred["scores"], np.exp(want) / np.exp(want).sum(), atol=TOL)
    raw = _classify(core, {"task": "swag", "inputs": [{"text": context, "choices": three}], "raw_scores": True})
    np.testing.assert_allclose(raw["predictions"][0]["scores"], want, atol=TOL)
    # 2 and 5 choices (the head was trained with 3): each choice's logit is its pair's, whatever the others
    more = [*three, "the dog", "a mat"]
    for choices in (three[:2], more):
        got = _classify(core, {"task": "swag", "inputs": [{"text": context, "choices": choices}], "raw_scores": True})
        logits = got["predictions"][0]["scores"]
        np.testing.assert_allclose(logits[: min(3, len(choices))], want[: len(choices)], atol=TOL)
    two = _classify(core, {"task": "swag", "inputs": [{"text": context, "choices": more[3:]}], "raw_scores": True})
    np.testing.assert_allclose(two["predictions"][0]["scores"], logits[3:], atol=TOL)


def test_multiple_choice_over_grpc(core, heads):
    three = ["the cat sat", "a good film", "it is boring"]
    msg = pb.ClassifyRequest(task="swag", inputs=[pb.Input(text=SENTENCES[0], choices=three)])
    reply = response_message(_classify(core, request_fields(msg)))
    want = heads.reference("swag", [(SENTENCES[0], three)])[0]
    p = reply.predictions[0]
    assert p.choice == int(np.argmax(want)) and p.label == three[p.choice] and list(reply.labels) == []
    np.testing.assert_allclose(list(p.scores), np.exp(want) / np.exp(want).sum(), atol=TOL)


def test_tagged_offsets_point_into_the_text_as_sent_whichever_side_was_cut(core):
    """A text past the characters the tokenizer reads (token limit x 32) is cut before it is tokenized; cut at its
    start ("left"), the offsets are moved back so that the answer's start/end index the text as sent."""
    from fusionserve.serving.model import heads
    from fusionserve.serving.model.artifact import TaskEntry

    encoder = core.encoder
    words = ("the cat sat on the mat and the dog was not very fun " * 200).split()
    text = " ".join(words)
    assert len(text) > encoder.max_chars
    entry = TaskEntry("ner", 0, "head", ("O", "B-X", "I-X"), (), (), "tagging")
    for direction in ("right", "left"):
        unit = heads.units(encoder, "tagging", [TextInput(text)], direction, heads.HeadOptions())[0]
        logits = np.tile(np.array([[0.0, 5.0, 0.0]], dtype=np.float32), (len(unit.rows[0].ids), 1))  # every piece B-X
        got = heads.answer(entry, TextInput(text), unit, [logits], heads.HeadOptions())
        tokens = got["tokens"]
        assert got["truncated"] and len(tokens) == encoder.max_length - 2
        assert all(text[t["start"] : t["end"]] == t["word"] for t in tokens), tokens[:3]
        kept = tokens[-1]["end"] if direction == "left" else tokens[0]["start"]
        assert kept == (len(text) if direction == "left" else 0)
