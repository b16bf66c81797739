"""Heads beyond classification in files: ``fusionserve predict`` and ``score`` (JSONL, CSV, Parquet) on the tiny
model with heads saved by the real AdapterHub library. A regression task writes its value, AdapterHub's (it wrote
"LABEL_0" and a probability of 1.0 before); a row a task's head cannot read is one line of the side file and the job
goes on; an option no task reads stops the job at once with one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from fusionserve.cli.main import main
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.heads_helpers import HeadsModel, build_heads

pytestmark = pytest.mark.xdist_group("local_ray")  # with test_score_ray: one Ray start for both (conftest.local_ray)

TOL = 1e-4


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> HeadsModel:
    return build_heads(tmp_path_factory.mktemp("heads-files"), shared=tmp_path_factory)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_predict_writes_a_regression_tasks_value(heads, tmp_path, capsys):
    rows = [{"text": SENTENCES[0], "id": "a"}, {"text": PAIRS[1][0], "text_pair": PAIRS[1][1]}, {"text": SENTENCES[3]}]
    src, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["predict", str(heads.artifact), "--task", "sts", "--input", str(src), "--output", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["id"] == "a" and [set(x) - {"id"} for x in lines] == [{"score"}] * 3, lines
    want = heads.reference("sts", [SENTENCES[0], PAIRS[1], SENTENCES[3]])[:, 0]
    np.testing.assert_allclose([x["score"] for x in lines], want, atol=TOL, rtol=0)
    assert main(["predict", str(heads.artifact), "--task", "sick", "--text", SENTENCES[1]]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["score"] == pytest.approx(float(heads.reference("sick", [SENTENCES[1]])[0, 0]), abs=TOL)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_score_adds_a_regression_tasks_value_beside_a_classification_tasks_label(heads, tmp_path, fmt):
    texts = SENTENCES * 2
    src = tmp_path / "in.csv"
    with src.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["text"])
        w.writerows([t] for t in texts)
    out = tmp_path / f"out.{fmt}"
    argv = ["score", str(heads.artifact), "--task", "sts", "--task", "rte", "--input", str(src), "--output", str(out)]
    assert main([*argv, "--all-scores"]) == 0
    if fmt == "parquet":
        got = pq.read_table(out).to_pylist()
    elif fmt == "csv":
        got = list(csv.DictReader(out.open()))
    else:
        got = [json.loads(line) for line in out.read_text().splitlines()]
    assert list(got[0]) == [
        "text",
        "sts_score",
        "rte_label",
        "rte_score",
        *(f"rte_score_{x}" for x in ("entailment", "neutral", "contradiction")),
    ]
    np.testing.assert_allclose([float(r["sts_score"]) for r in got], heads.reference("sts", texts)[:, 0], atol=TOL, rtol=0)


def test_options_no_task_reads_stop_the_job_in_one_line(heads, tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    for extra, says in [
        (["--aggregation-strategy", "simple"], "--aggregation-strategy applies to tagging tasks only; 'sts' is regression"),
        (["--aggregation-strategy", "most"], "--aggregation-strategy 'most' is not known; allowed: none, simple"),
        (["--top-k", "0"], "--top-k must be a whole number 1..100, got 0"),
    ]:
        for command in (["score", "--output", str(tmp_path / "o.jsonl")], ["predict"]):
            code = main([command[0], str(heads.artifact), "--task", "sts", "--input", str(src), *command[1:], *extra])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and says in err[0], (command, err)


def test_rows_a_regression_task_cannot_read_are_reported_and_the_rest_scored(heads, tmp_path, capsys):
    rows = [{"text": "good"}, {"text": "a", "choices": ["x", "y"]}, {"question": "q", "context": "c"}, {"text": "fine"}]
    src, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["predict", str(heads.artifact), "--task", "sts", "--input", str(src), "--output", str(out)]) == 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [("score" in x, x.get("line")) for x in lines] == [(True, None), (False, 2), (False, 3), (True, None)]
    assert "task 'sts' is regression: an input is" in lines[1]["error"]


THREE = ["the cat sat", "a good film", "it is boring"]


def test_predict_writes_a_multiple_choice_tasks_choice(heads, tmp_path, capsys):
    rows = [
        {"text": SENTENCES[0], "choices": THREE, "id": 1},
        {"text": SENTENCES[1], "choices": ["only"]},
        {"text": "no choices"},
    ]
    src, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert main(["predict", str(heads.artifact), "--task", "swag", "--input", str(src), "--output", str(out)]) == 1
    first, one, none = (json.loads(line) for line in out.read_text().splitlines())
    want = heads.reference("swag", [(SENTENCES[0], THREE)])[0]
    assert first["id"] == 1 and first["choice"] == int(np.argmax(want)) and first["label"] == THREE[first["choice"]]
    np.testing.assert_allclose(first["logits"], want, atol=TOL)
    assert one == {"line": 2, "error": "'choices' holds 1 choice; a multiple-choice input needs 2 to 64"}
    assert none["line"] == 3 and "task 'swag' is multiple_choice" in none["error"] and "without 'choices'" in none["error"]
    argv = [
        "predict",
        str(heads.artifact),
        "--task",
        "swag",
        "--text",
        SENTENCES[0],
        *(x for c in THREE for x in ("--choice", c)),
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["choice"] == first["choice"]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_score_reads_choices_from_a_column_and_reports_rows_without_them(heads, tmp_path, fmt):
    good = {"text": SENTENCES[0], "choices": THREE}
    rows = [good, {"text": SENTENCES[1], "choices": ["one"]}, {"text": SENTENCES[2], "choices": None}, good]
    out = tmp_path / f"out.{fmt}"
    if fmt == "csv":
        src = tmp_path / "in.csv"
        with src.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["text", "options"])
            w.writerows([r["text"], "" if r["choices"] is None else json.dumps(r["choices"])] for r in rows)
    else:
        import pyarrow as pa

        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"text": [r["text"] for r in rows], "options": [r["choices"] for r in rows]}), src)
    argv = [
        "score",
        str(heads.artifact),
        "--task",
        "swag",
        "--input",
        str(src),
        "--output",
        str(out),
        "--choices-field",
        "options",
    ]
    assert main([*argv, "--all-scores"]) == 1  # bad rows: exit 1, the rest scored
    got = pq.read_table(out).to_pylist() if fmt == "parquet" else list(csv.DictReader(out.open()))
    want = heads.reference("swag", [(SENTENCES[0], THREE)])[0]
    assert len(got) == 2 and [int(r["choice"]) for r in got] == [int(np.argmax(want))] * 2
    scores = got[0]["scores"] if fmt == "parquet" else json.loads(got[0]["scores"])
    np.testing.assert_allclose(scores, np.exp(want) / np.exp(want).sum(), atol=TOL)
    errors = [json.loads(line) for line in (tmp_path / f"out.{fmt}.errors.jsonl").read_text().splitlines()]
    if fmt == "csv":  # an empty cell is an empty string
        assert errors[1]["error"].startswith("field 'options' must be a list of texts (in CSV: a JSON array")
    else:
        assert errors[1]["error"] == "missing field 'options': a multiple-choice task reads its choices there"
    assert [e["row"] for e in errors] == [2, 3] and errors[0]["error"].startswith("field 'options' holds 1 choice; a multiple")


def test_evaluate_reports_correlation_for_regression_and_accuracy_for_multiple_choice(heads, tmp_path, capsys):
    texts = SENTENCES + [" ".join(p) for p in PAIRS]
    values = heads.reference("sts", texts)[:, 0]
    gold = [2 * v + 1 for v in values]  # a monotone map of the model's values: Pearson and Spearman 1
    gold[0], gold[1] = gold[1], gold[0]  # ... but two swapped: below 1
    lines = [{"text": t, "label": float(g)} for t, g in zip(texts, gold, strict=True)] + [{"text": "no label"}]
    src = _jsonl(tmp_path / "sts.jsonl", lines)
    assert main(["evaluate", str(heads.artifact), "--task", "sts", "--input", str(src), "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    from scipy.stats import pearsonr, spearmanr

    assert got["head"] == "regression" and got["examples"] == len(texts) and got["bad_lines"] == 1
    assert got["pearson"] == pytest.approx(pearsonr(gold, values)[0], abs=1e-4) and got["pearson"] < 1
    assert got["spearman"] == pytest.approx(spearmanr(gold, values)[0], abs=1e-4) and got["spearman"] < 1
    assert "line 9: missing field 'label'" in out.err
    contexts = SENTENCES[:4]
    best = [int(np.argmax(heads.reference("swag", [(c, THREE)])[0])) for c in contexts]
    lines = [{"text": c, "choices": THREE, "label": b} for c, b in zip(contexts, best, strict=True)]
    lines[0]["label"] = (best[0] + 1) % 3  # one wrong: 75%
    lines[1]["label"] = THREE[best[1]]  # the right choice's text counts as its index
    lines.append({"text": "x", "choices": THREE, "label": 3})
    src = _jsonl(tmp_path / "swag.jsonl", lines)
    assert main(["evaluate", str(heads.artifact), "--task", "swag", "--input", str(src)]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "swag (multiple_choice): accuracy 75.00% over 4 examples", out.out
    assert "'label' must be the right choice's index 0..2 or its text, got 3" in out.err


TAGGED = [SENTENCES[1], "the dog sat on a mat and the cat is not boring"]
QUESTION = {"question": "what is not very fun", "context": " ".join(SENTENCES)}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_score_writes_tagging_entities_and_qa_answers_as_the_pipelines_give_them(heads, tmp_path, fmt):
    rows = [{"text": t, **QUESTION} for t in TAGGED] + [{"text": TAGGED[0], "question": "who"}]  # the last: no context
    src = _jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / f"out.{fmt}"
    argv = ["score", str(heads.artifact), "--task", "ner", "--task", "squad", "--input", str(src), "--output", str(out)]
    assert main([*argv, "--aggregation-strategy", "simple", "--top-k", "2"]) == 1  # one bad row
    if fmt == "parquet":
        got = pq.read_table(out).to_pylist()
    elif fmt == "csv":
        got = [
            {k: json.loads(v) if k in ("ner_entities", "squad_answers") else v for k, v in r.items()}
            for r in csv.DictReader(out.open())
        ]
    else:
        got = [json.loads(line) for line in out.read_text().splitlines()]
    cols = ["ner_entities", "squad_answer", "squad_score", "squad_start", "squad_end", "squad_answers"]
    assert len(got) == 2 and list(got[0])[-len(cols) :] == cols
    nlp, qa = heads.pipeline("ner"), heads.pipeline("squad")
    answers = qa(**QUESTION, top_k=2, max_seq_len=32)
    for row, text in zip(got, TAGGED, strict=True):
        want = nlp(text, aggregation_strategy="simple")
        assert [{k: v for k, v in e.items() if k != "score"} for e in row["ner_entities"]] == [
            {k: (int(v) if k in ("start", "end") else v) for k, v in e.items() if k != "score"} for e in want
        ]
        assert [a["answer"] for a in row["squad_answers"]] == [a["answer"] for a in answers]
        assert (row["squad_answer"], int(row["squad_start"])) == (answers[0]["answer"], answers[0]["start"])
        assert float(row["squad_score"]) == pytest.approx(answers[0]["score"], abs=1e-5)
    errors = (tmp_path / f"out.{fmt}.errors.jsonl").read_text().splitlines()
    assert [json.loads(e) for e in errors] == [{"row": 3, "error": "missing field 'context'"}]


def test_predict_writes_tokens_and_answers(heads, tmp_path, capsys):
    assert main(["predict", str(heads.artifact), "--task", "ner", "--text", TAGGED[1], "--aggregation-strategy", "max"]) == 0
    entities = json.loads(capsys.readouterr().out)["entities"]
    want = heads.pipeline("ner")(TAGGED[1], aggregation_strategy="max")
    assert [e["word"] for e in entities] == [e["word"] for e in want] and entities
    argv = [
        "predict",
        str(heads.artifact),
        "--task",
        "squad",
        "--question",
        QUESTION["question"],
        "--context",
        QUESTION["context"],
    ]
    assert main(argv) == 0
    line = json.loads(capsys.readouterr().out)
    best = heads.pipeline("squad")(**QUESTION, max_seq_len=32)
    assert (line["answer"], line["start"], line["end"]) == (best["answer"], best["start"], best["end"])
    src = _jsonl(tmp_path / "qa.jsonl", [QUESTION, {"question": "who"}, {"text": "not a question"}])
    assert main(["predict", str(heads.artifact), "--task", "squad", "--input", str(src), "--top-k", "3"]) == 1
    first, no_context, a_text = (json.loads(x) for x in capsys.readouterr().out.splitlines())
    assert len(first["answers"]) == 3 and first["answers"][0]["answer"] == best["answer"]
    assert no_context == {
        "line": 2,
        "error": 'missing field \'context\': a question-answering input is {"question": ..., "context": ...}',
    }
    assert a_text["line"] == 3 and "task 'squad' is question_answering" in a_text["error"]


def test_evaluate_reports_entity_f1_for_tagging_and_exact_match_for_qa(heads, tmp_path, capsys):
    words = TAGGED[1].split()
    pred = [e for e in heads.pipeline("ner")(TAGGED[1], aggregation_strategy="first")]
    tags = ["O"] * len(words)  # the model's own entities (first piece per word) as gold: F1 100
    starts = {sum(len(w) + 1 for w in words[:i]): i for i in range(len(words))}
    for e in pred:
        first = starts[e["start"]]
        last = max(i for s, i in starts.items() if s < e["end"])
        tags[first : last + 1] = [f"B-{e['entity_group']}"] + [f"I-{e['entity_group']}"] * (last - first)
    lines = [{"tokens": words, "tags": tags}, {"tokens": words, "tags": ["O"] * (len(words) - 1)}]
    src = _jsonl(tmp_path / "ner.jsonl", lines)
    assert main(["evaluate", str(heads.artifact), "--task", "ner", "--input", str(src), "--json"]) == 0
    out = capsys.readouterr()
    got = json.loads(out.out)
    assert pred and (got["head"], got["examples"], got["f1"], got["precision"], got["recall"]) == (
        "tagging",
        1,
        100.0,
        100.0,
        100.0,
    )
    assert "'tags' must be a list of one tag per word" in out.err
    best = heads.pipeline("squad")(**QUESTION, max_seq_len=32)["answer"]
    lines = [{**QUESTION, "answers": [best]}, {**QUESTION, "answers": {"text": ["certainly not this"], "answer_start": [0]}}]
    src = _jsonl(tmp_path / "qa.jsonl", lines)
    assert main(["evaluate", str(heads.artifact), "--task", "squad", "--input", str(src)]) == 0
    assert capsys.readouterr().out.startswith("squad (question_answering): exact_match 50.00%, f1 50.00% over 2 examples")


def test_predict_with_the_spec_runs_every_head_as_the_artifact_does(heads, tmp_path, capsys):
    """A spec runs on the PyTorch model: its tasks have the heads the checkpoints have (they read as classification,
    or regression by label count, before: a multiple-choice input was refused, a tagging task took no strategy)."""
    rows = [{"text": SENTENCES[0], "choices": THREE}, QUESTION, {"text": TAGGED[1]}]
    for task, row, options in [
        ("swag", rows[0], []),
        ("squad", rows[1], []),
        ("ner", rows[2], ["--aggregation-strategy", "first"]),
    ]:
        src = _jsonl(tmp_path / f"{task}.jsonl", [row])
        lines = []
        for model in (heads.artifact, heads.spec):
            assert main(["predict", str(model), "--task", task, "--input", str(src), *options]) == 0
            lines.append(json.loads(capsys.readouterr().out))
        onnx, torch_line = lines
        assert onnx.keys() == torch_line.keys()
        for key in onnx:
            if key == "entities":
                assert [x["word"] for x in onnx[key]] == [x["word"] for x in torch_line[key]]
            elif key == "score":  # QA: which windows' spans make the candidates moves with logits 1e-6 apart (random heads)
                assert onnx[key] > 0 and torch_line[key] > 0
            elif key in ("scores", "logits"):
                np.testing.assert_allclose(onnx[key], torch_line[key], atol=TOL)
            else:
                assert onnx[key] == torch_line[key], key


@pytest.mark.slow
def test_score_on_ray_data_writes_what_the_local_run_writes_for_every_head(heads, tmp_path, local_ray):
    from fusionserve.scoring.config import ScoreConfig
    from fusionserve.scoring.score import score_file

    rows = [{"text": t, "choices": THREE, **QUESTION} for t in TAGGED * 3] + [{"text": "x", "choices": ["one"], **QUESTION}]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    options = {"task": ("ner", "swag", "squad", "sts"), "aggregation_strategy": "average", "top_k": 2, "all_scores": True,
               "progress": False, "chunk_size": 4}  # fmt: skip
    # the default pool, one actor per CPU (two), on the JSONL output: the order of every head's answers across actors;
    # one actor on the Parquet output, whose nested columns (entities, answers) are what differ (each actor is a Ray
    # worker that imports the scorer and loads the model)
    for out, actors in (("out.parquet", 1), ("out.jsonl", None)):
        a = score_file(ScoreConfig(heads.artifact, input=src, output=tmp_path / f"local-{out}", **options))
        b = score_file(
            ScoreConfig(heads.artifact, input=src, output=tmp_path / f"ray-{out}", ray=True, ray_actors=actors, **options)
        )
        assert (a.scored, a.failed) == (b.scored, b.failed) == (6, 1)
        local, remote = tmp_path / f"local-{out}", tmp_path / f"ray-{out}"
        if out.endswith(".parquet"):
            assert pq.read_table(remote).equals(pq.read_table(local))
            assert "list<element: struct<entity_group: string" in str(pq.read_schema(local).field("ner_entities").type)
        else:
            assert remote.read_bytes() == local.read_bytes()
