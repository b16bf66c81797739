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
from fusionserve.serving.model import heads as heads_module
from fusionserve.serving.model.predictions import QAInput, TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.scheduler.batching import BatchLimits, Scheduler
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.heads_helpers import HeadsModel, build_heads

TOL = 1e-4
THREE = ["the cat sat", "a good film", "it is boring"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> HeadsModel:
    return build_heads(tmp_path_factory.mktemp("heads"), shared=tmp_path_factory)


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
    "a pair to tag": (
        {"task": "ner", "inputs": [{"text": "a", "text_pair": "b"}]}, 422, "invalid_input",
        "task 'ner' is tagging: it tags one text",
    ),
    "raw scores aggregated": (
        {"task": "ner", "inputs": ["a"], "raw_scores": True, "aggregation_strategy": "simple"}, 422, "invalid_option",
        "raw_scores gives each word piece's logits: it needs aggregation_strategy 'none'",
    ),
    "raw scores of QA": (
        {"task": "squad", "inputs": [{"question": "q", "context": "c"}], "raw_scores": True}, 422, "invalid_option",
        "raw_scores: task 'squad' is question_answering",
    ),
    "a text for QA": ({"task": "squad", "inputs": ["a"]}, 422, "invalid_input", "without 'question' and 'context'"),
    "windows over the limit": (
        {"task": "squad", "inputs": [{"question": "who", "context": " ".join(SENTENCES * 12)}]}, 413, "too_many_inputs",
        "the request makes 37 rows (inputs[0] makes 37; a choice or a window of a long context is a row); the limit is 16",
    ),
    "question too long": (
        {"task": "squad", "inputs": [{"question": "the cat " * 14, "context": " ".join(SENTENCES * 2)}]}, 422,
        "invalid_input", "inputs[0]: the question is 28 tokens",
    ),
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


TAGGED = [SENTENCES[0], SENTENCES[1], "the dog sat on a mat and the cat is not boring", SENTENCES[4]]
CONTEXT = " ".join(SENTENCES)  # 45 tokens: read in several windows of 32
QUESTIONS = [("what is not very fun", CONTEXT), ("who sat", SENTENCES[2]), ("is the plot boring", " ".join(SENTENCES[::-1]))]


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_tagging_answers_the_token_classification_pipelines_entities(core, heads, strategy):
    nlp = heads.pipeline("ner")
    out = _classify(core, {"task": "ner", "inputs": TAGGED, "aggregation_strategy": strategy})
    assert not isinstance(out, HTTPError), out
    key = "tokens" if strategy == "none" else "entities"
    compared = 0
    for pred, text in zip(out["predictions"], TAGGED, strict=True):
        theirs = nlp(text, aggregation_strategy=strategy)
        assert list(pred) == [key, "truncated"] and len(pred[key]) == len(theirs), (pred, theirs)
        for ours, want in zip(pred[key], theirs, strict=True):
            assert {k: v for k, v in ours.items() if k != "score"} == {k: v for k, v in want.items() if k != "score"}
            assert ours["score"] == pytest.approx(float(want["score"]), abs=1e-5)
            compared += 1
    assert compared >= 4


def test_tagging_raw_scores_are_each_pieces_logits(core, heads):
    out = _classify(core, {"task": "ner", "inputs": TAGGED[:1], "raw_scores": True})
    tokens = out["predictions"][0]["tokens"]
    logits = heads.reference("ner", TAGGED[:1])[0]  # (seq, labels), [CLS] first
    for t in tokens:
        np.testing.assert_allclose(list(t["scores"].values()), logits[t["index"]], atol=TOL)
        assert list(t["scores"]) == ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


@pytest.mark.parametrize(
    "options",
    [{}, {"top_k": 3}, {"max_answer_len": 2, "top_k": 2}, {"handle_impossible_answer": True, "top_k": 2}, {"doc_stride": 4}],
    ids=["defaults", "top_k", "max_answer_len", "impossible", "doc_stride"],
)
def test_question_answering_answers_the_pipelines_answers(core, heads, options):
    qa = heads.pipeline("squad")
    inputs = [{"question": q, "context": c} for q, c in QUESTIONS]
    out = _classify(core, {"task": "squad", "inputs": inputs, **options})
    assert not isinstance(out, HTTPError), out
    first = heads_module.units(core.encoder, "question_answering", [QAInput(*QUESTIONS[0])], "right", heads_module.HeadOptions())
    assert len(first[0].rows) > 1  # the context is read in several windows
    for pred, (q, c) in zip(out["predictions"], QUESTIONS, strict=True):
        theirs = qa(question=q, context=c, max_seq_len=32, **options)
        ours, want = (pred, theirs) if isinstance(theirs, list) else ([pred], [theirs])
        assert len(ours) == len(want) and all(isinstance(a, dict) for a in ours), (pred, theirs)
        for a, b in zip(ours, want, strict=True):
            assert (a["answer"], a["start"], a["end"]) == (b["answer"], b["start"], b["end"]), (a, b)
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)


def test_one_batch_mixes_all_five_kinds_and_each_answers_as_alone(core, heads):
    """Requests of the five head kinds queued while the model is busy leave in one batch (one forward pass over rows of
    every kind: the graph gathers each row's head by task id), and each answers what it answers alone."""
    from fusionserve.serving.scheduler.results import BatchStats
    from tests.batching_helpers import Gate

    runner = OnnxRunner(heads.artifact, threads=1, device="cpu")
    batches: list[BatchStats] = []
    sched = Scheduler(runner, BatchLimits(max_batch_size=64), batches.append)
    mixed = Classifier(runner.encoder, sched, Limits(max_inputs=16), Metrics())
    work = [
        {"task": "rte", "inputs": [SENTENCES[0]]},
        {"task": "sts", "inputs": [SENTENCES[1]]},
        {"task": "swag", "inputs": [{"text": SENTENCES[2], "choices": THREE}]},
        {"task": "ner", "inputs": [TAGGED[2]], "aggregation_strategy": "simple"},
        {"task": "squad", "inputs": [{"question": QUESTIONS[0][0], "context": QUESTIONS[0][1]}]},
    ]
    gate = Gate(runner)

    async def scenario():
        gate.close()
        first = asyncio.ensure_future(sched.submit("rte", [TextInput(SENTENCES[3])]))
        while not gate.entered.is_set():
            await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(mixed(_reader(body), "test")) for body in work]
        while sched.queued_rows < 1 + 1 + 3 + 1 + 2:  # the QA context is two windows
            await asyncio.sleep(0.01)
        gate.release.set()
        await first
        return await asyncio.gather(*rest)

    together = asyncio.run(scenario())
    assert len(batches) == 2 and batches[1].tasks.keys() == {"rte", "sts", "swag", "ner", "squad"}, batches
    for body, got in zip(work, together, strict=True):
        _same(got, _classify(core, body))


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


def _reader(body: dict):
    async def read():
        return parse_fields(body)

    return read


def test_a_request_whose_rows_span_batches_records_every_batch_for_its_trace(core, heads):
    """A multiple-choice input (a row per choice) and a question-answering input (a row per window) on a scheduler
    that takes 2 rows (1 row) a batch: each request's rows run in several batches, its answer is the one a single
    batch gives, and its result names every batch its rows ran in, in order (``JobResult.spans``: the trace's
    per-batch spans, serving/api/tracing.py), each within the request's time."""
    from fusionserve.serving.model.predictions import ChoiceInput

    runner = OnnxRunner(heads.artifact, threads=1, device="cpu")
    for task, inp, size in [("swag", ChoiceInput(SENTENCES[2], tuple(THREE)), 2), ("squad", QAInput(*QUESTIONS[0]), 1)]:
        sched = Scheduler(runner, BatchLimits(max_batch_size=size))
        split = asyncio.run(sched.submit(task, [inp]))
        whole = asyncio.run(core.scheduler.submit(task, [inp]))
        rows = len(whole.tasks[task].outputs[0])  # 3 choices; the context's windows
        assert rows > size and whole.batches == 1 and split.batches == -(-rows // size) == len(split.spans), split
        for a, b in zip(split.tasks[task].outputs[0], whole.tasks[task].outputs[0], strict=True):
            np.testing.assert_allclose(a, b, atol=TOL)
        assert sum(s.inputs for s in split.spans) == rows and all(s.tasks == (task,) for s in split.spans)
        at = split.submitted_s
        for step in [split.tokenized_s] + [t for s in split.spans for t in (s.taken_s, s.model_start_s, s.model_end_s)]:
            assert at <= step, (task, split)
            at = step
