"""Every head kind through the export: one graph whose `logits` hold the sequence-level heads and whose `token_logits` hold
the token-level ones, gathered per row by task_id, so one batch mixes all five kinds and each row answers as AdapterHub
does; the manifest names each task's head (regression says regression); baked and live; fp16 and int8 each with its
gate; `tasks add` of a multiple-choice, regression and QA head on a live artifact; calibrate (fusion activations do not
depend on the head) and prune; `inspect` names the kinds."""

import json

import numpy as np
import pytest

from fusionserve.export.artifact import export_artifact
from fusionserve.serving.model.artifact import load_artifact, render_manifest
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.export_helpers import _cli
from tests.head_kinds import CONTEXTS, HEADS, TAGS, add_heads, kind
from tests.live_helpers import live_once

TOL = 1e-4
MAX_SEQ_LEN = 40
ALL = ("label_fused", "score_fused", "score_single", "choose_fused", "choose_single", "tags_fused", "tags_single",
       "span_fused", "span_single")  # fmt: skip


@pytest.fixture(scope="module")
def baked(bert_heads, tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads-baked") / "art"
    export_artifact(bert_heads.spec, folder, max_seq_len=MAX_SEQ_LEN, progress=False)
    return folder


def _rows(tasks):
    """One batch mixing ``tasks``: a multiple-choice task gets the pairs (context, choice) of CONTEXTS[0], every other a
    text or a pair of the test sentences; (task per row, inputs)."""
    texts = [*SENTENCES, *PAIRS]
    per_row, inputs = [], []
    for i, name in enumerate(tasks):
        if kind(name) == "multiple_choice":
            context, choices = CONTEXTS[0]
            per_row += [name] * len(choices)
            inputs += [TextInput(context, c) for c in choices]
        else:
            t = texts[i % len(texts)]
            per_row.append(name)
            inputs.append(TextInput(*t) if isinstance(t, tuple) else TextInput(t))
    return per_row, inputs


def _reference(hk, name, inp, adapters=None):
    """AdapterHub's answer for one row: (labels,) or (tokens, labels)."""
    batch = dict(hk.tokenizer(inp.text, inp.text_pair, return_tensors="pt", truncation=True, max_length=MAX_SEQ_LEN))
    return hk.outputs(name, batch, adapters)[0]


def _check_rows(hk, runner, tasks, adapters=None):
    """Every row of one batch mixing ``tasks`` against AdapterHub; returns the worst difference."""
    per_row, inputs = _rows(tasks)
    out = runner.run_rows(per_row, runner.encoder.encode(inputs)).logits
    worst = 0.0
    for name in dict.fromkeys(per_row):
        idx = [i for i, t in enumerate(per_row) if t == name]
        if kind(name) == "multiple_choice":
            _, ref = hk.choices(name, [CONTEXTS[0]], adapters=adapters)
            got = np.array([out[i][0] for i in idx])
            worst = max(worst, float(np.abs(got - ref[0]).max()))
            continue
        for i in idx:
            ref = _reference(hk, name, inputs[i], adapters)
            assert out[i].shape == ref.shape, (name, out[i].shape, ref.shape)
            worst = max(worst, float(np.abs(out[i] - ref).max()))
    return worst


def test_the_manifest_names_each_task_s_head_and_the_graph_s_outputs(baked):
    art = load_artifact(baked)
    m = art.manifest
    assert m["io"]["outputs"] == ["logits", "fusion_activations", "token_logits"] and list(m["outputs"]) == m["io"]["outputs"]
    assert m["outputs"]["token_logits"].startswith(f"float32 (batch, sequence, {len(TAGS)})")
    heads = {name: (t["head"], t["labels"], t.get("num_choices")) for name, t in m["tasks"].items()}
    assert heads["label_fused"] == ("classification", ["entailment", "neutral", "contradiction"], None)
    assert heads["score_fused"] == heads["score_single"] == ("regression", ["score"], None)  # not "LABEL_0"
    assert heads["choose_fused"] == ("multiple_choice", ["choice"], 3)
    assert heads["tags_single"] == ("tagging", TAGS, None)
    assert heads["span_fused"] == ("question_answering", ["start", "end"], None)
    entries = art.tasks
    assert entries["score_single"].head == "regression" and entries["tags_fused"].level == "token"
    assert entries["choose_fused"].num_choices == 3 and entries["choose_fused"].level == "sequence"
    parity = m["parity"]
    assert set(parity["max_abs_diff"]) == {"logits", "fusion_activations", "token_logits"}
    assert parity["max_abs_diff"]["token_logits"] <= TOL and parity["tolerance"]["token_logits"] == TOL
    assert parity["worst_case"]["token_logits"].startswith(("task tags", "task span", "tasks ["))


def test_one_batch_mixing_every_kind_answers_each_row_as_adapterhub(bert_heads, baked):
    runner = OnnxRunner(baked, threads=1)
    assert runner.per_row_tasks
    assert _check_rows(bert_heads, runner, ALL) <= TOL
    # each task alone (one task_id for the batch) gives the same rows as the mixed batch
    alone = _check_rows(bert_heads, runner, ("tags_fused",))
    assert alone <= TOL


def test_live_export_serves_every_kind_from_its_tables(bert_heads, tmp_path):
    folder = tmp_path / "live"
    m = export_artifact(bert_heads.spec, folder, max_seq_len=MAX_SEQ_LEN, progress=False, live=True, parity_grid="quick")
    # quick grid: the whole grid (3 batch sizes x 2 lengths) for the first fusion and single-adapter task of each head
    # level (label_fused, score_single, tags_fused, tags_single), one case for the 5 others, a mixed batch per length
    assert m["parity"]["grid"]["kind"] == "quick" and m["parity"]["cases"] == 4 * 6 + 5 + 2
    live = m["live"]
    assert live["head_form"] == {"layers": 2, "activation": "tanh", "use_pooler": False} and live["logits_width"] == 3
    assert live["token_head_form"] == {"layers": 1, "activation": None, "use_pooler": False}
    assert live["token_logits_width"] == len(TAGS)
    assert [t for t in live["tables"] if t.startswith("task.token_head.")] == ["task.token_head.w0", "task.token_head.b0"]
    assert _check_rows(bert_heads, OnnxRunner(folder, threads=1), ALL) <= TOL


def test_fp16_and_int8_gate_every_kind(bert_heads, tmp_path):
    m16 = export_artifact(bert_heads.spec, tmp_path / "fp16", precision="fp16", max_seq_len=MAX_SEQ_LEN, progress=False)
    assert m16["parity"]["tolerance"]["token_logits"] == 5e-2 and m16["parity"]["max_abs_diff"]["token_logits"] <= 5e-2
    assert _check_rows(bert_heads, OnnxRunner(tmp_path / "fp16", threads=1), ALL) <= 5e-2
    m8 = export_artifact(bert_heads.spec, tmp_path / "int8", precision="int8", max_seq_len=MAX_SEQ_LEN, progress=False)
    gate = m8["int8"]["gate"]
    assert gate["thresholds"]["min_regression_correlation"] == 0.95
    assert set(gate["heads"]) == {"regression", "multiple_choice", "tagging", "question_answering"}
    assert gate["heads"]["regression"]["correlation"] >= 0.95 and gate["heads"]["regression"]["rows"] > 0
    for k in ("multiple_choice", "tagging", "question_answering"):
        figures = gate["heads"][k]
        assert figures["count"] > 0 and figures["agreement"] >= 0.85 and figures["max_probability_change"] <= 0.3, k
    assert gate["heads"]["tagging"]["units"] == "tokens" and gate["rows"] > 0  # label_fused's rows
    text = render_manifest(m8)
    for k in ("regression: correlation", "multiple_choice: agreement", "tagging: agreement", "question_answering: agreement"):
        assert k in text, text


def test_bf16_gates_each_row_on_its_own_head(bert_heads, tmp_path):
    """bf16 (OpenVINO; emulated where the CPU has AVX-512 but no bf16 units): each task's rows are gated on the output
    its head answers in (a tagging or QA row on token_logits, not on the zero placeholder of logits)."""
    pytest.importorskip("openvino")
    m = export_artifact(bert_heads.spec, tmp_path / "bf16", precision="bf16", max_seq_len=MAX_SEQ_LEN, progress=False)
    gate = m["bf16"]["gate"]
    assert gate["label_agreement"] >= 0.97 and 0 < gate["max_logit_change"] <= 0.25
    assert gate["rows"] > gate["cases"] * 3  # tagging rows count every real token
    assert _check_rows(bert_heads, OnnxRunner(tmp_path / "bf16", threads=1), ALL) <= 0.25


def test_the_bf16_gate_counts_token_flips_and_qa_spans():
    from fusionserve.export.bf16 import Bf16Gate, Bf16Report

    report = Bf16Report(Bf16Gate())
    real = np.array([[True, True, True, False]])
    logits = np.random.default_rng(0).normal(size=(1, 4, 3))
    report.add("tagging", logits, -logits, real, "there")  # every real token's label flips: 0 of 3 agree
    assert (report.rows, report.agreeing) == (3, 0) and report.worst["logits"] == "there"
    spans = np.zeros((1, 4, 2))
    spans[0, 3] = 9.0  # a padded token's huge logit is not read
    report.add("question_answering", spans, spans, real, "here")
    assert (report.rows, report.agreeing) == (5, 2)
    assert any("label agreement 40.00%" in line for line in report.failures())


def test_an_int8_gate_fails_by_kind_and_names_it():
    """A tagging head whose labels flip is refused with its own figure, however well the classification rows keep."""
    from fusionserve.export.int8.gate import GateReport, Int8Gate

    report = GateReport(Int8Gate())
    real = np.ones((2, 4), dtype=bool)
    logits = np.random.default_rng(0).normal(size=(2, 4, 3))
    report.add("classification", logits[:, 0], logits[:, 0], real, "here")
    report.add("tagging", logits, -logits, real, "there")
    report.add("regression", logits[:, :, 0], -logits[:, :, 0], real, "anywhere")
    bad = report.failures()
    assert len(bad) == 3 and "tagging: agreement" in bad[0] and "tokens" in bad[0] and "at there" in bad[1]
    assert "regression: correlation with fp32 -1.0000 over 2 rows" in bad[2]


def test_tasks_add_takes_a_multiple_choice_and_a_regression_head_on_a_live_artifact(tmp_path_factory, tmp_path, capsys):
    """A live artifact exported with classification tasks only: a multiple-choice target and a regression target are
    added (their heads have the default classification head's form) and answer as AdapterHub; a tagging head has no
    place in its graph and is refused in one line."""
    live = live_once(tmp_path_factory, tmp_path / "m")  # its own build (add_heads adds to it); the export made once
    hk = add_heads(live.built.reference, live.root, live.built.tokenizer, classification="rte")
    art = live.copy(tmp_path / "art")
    r = live.root
    code, out, err = _cli(capsys, "tasks", "add", art, "swag", "--fusion", r / "fusions/custom", "--head", r / "heads/choose")
    assert code == 0, err
    assert "max |diff| logits" in out
    code, out, err = _cli(capsys, "tasks", "add", art, "sts", "--adapter", "alpha", "--head", r / "heads/score")
    assert code == 0 and "correlation" in out, err
    runner = OnnxRunner(art, threads=1)
    assert (runner.task("swag").head, runner.task("swag").num_choices, runner.task("sts").head) == (
        "multiple_choice",
        3,
        "regression",
    )
    context, choices = CONTEXTS[0]
    rows = runner.run_rows(["swag"] * len(choices), runner.encoder.encode([TextInput(context, c) for c in choices]))
    got = np.array([x[0] for x in rows.logits])
    _, ref = hk.choices("choose_fused", [CONTEXTS[0]], adapters=("gamma", "alpha"))
    assert np.abs(got - ref[0]).max() <= TOL
    got = runner.logits("sts", [TextInput(s) for s in SENTENCES])[0]
    ref = np.concatenate([_reference(hk, "score_single", TextInput(s), "alpha")[None] for s in SENTENCES])
    assert np.abs(got - ref).max() <= TOL

    state = sorted(p.name for p in (art / "revisions").iterdir())
    code, _, err = _cli(capsys, "tasks", "add", art, "ner", "--adapter", "alpha", "--head", r / "heads/tags")
    assert code == 2 and err.count("\n") == 1, err
    assert "a tagging head reads every token (token_logits); this artifact was exported without a token-level head" in err
    assert sorted(p.name for p in (art / "revisions").iterdir()) == state


def test_tasks_add_takes_token_level_heads_where_the_export_had_one(bert_heads, tmp_path, capsys):
    art = tmp_path / "live"
    export_artifact(bert_heads.spec, art, max_seq_len=MAX_SEQ_LEN, progress=False, live=True, parity_grid="quick",
                    tasks=["label_fused", "tags_fused"])  # fmt: skip
    r = bert_heads.spec.parent
    code, out, err = _cli(capsys, "tasks", "add", art, "qa", "--adapter", "gamma", "--head", r / "heads/span")
    assert code == 0 and "max |diff| token_logits" in out, err
    code, _, err = _cli(capsys, "tasks", "add", art, "mc", "--fusion", r / "fusions/dyn", "--head", r / "heads/choose")
    assert code == 0, err
    runner = OnnxRunner(art, threads=1)
    assert runner.task("qa").level == "token" and runner.task("qa").labels == ("start", "end")
    worst = 0.0
    for s in SENTENCES:
        got = runner.run_rows(["qa", "tags_fused"], runner.encoder.encode([TextInput(s), TextInput(s)])).logits
        worst = max(worst, float(np.abs(got[0] - _reference(bert_heads, "span_single", TextInput(s))).max()))
        worst = max(worst, float(np.abs(got[1] - _reference(bert_heads, "tags_fused", TextInput(s))).max()))
    assert worst <= TOL


def test_calibrate_and_prune_a_model_of_every_kind(bert_heads, baked, tmp_path, capsys):
    """The fusion activations of a task do not depend on its head: the tagging, QA and multiple-choice tasks that fuse the
    classification task's fusion get its statistics; pruning on them exports and serves every kind (the five fused
    tasks, one of each kind: the single-adapter tasks have no fusion to prune)."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    stats = tmp_path / "stats.json"
    fused = ["label_fused", "tags_fused", "span_fused", "choose_fused", "score_fused"]
    code, _, err = _cli(capsys, "calibrate", baked, *(a for t in fused for a in ("--task", t)), "--input", src, "--output", stats)
    assert code == 0, err
    per_task = json.loads(stats.read_text())["tasks"]
    for t in fused[1:]:
        assert per_task[t]["mean"] == per_task["label_fused"]["mean"], t
    pruned = tmp_path / "pruned"
    code, _, err = _cli(capsys, "prune", bert_heads.spec, "--stats", stats, "--keep-top", "2", "--out", pruned,
                          "--max-seq-len", MAX_SEQ_LEN, "--tasks", *fused)  # fmt: skip
    assert code == 0, err
    m = load_artifact(pruned).manifest
    assert set(m["pruning"]["tasks"]) == set(m["tasks"]) == set(fused)  # the fused task of each kind (--tasks)
    assert m["tasks"]["tags_fused"]["head"] == "tagging"
    assert m["parity"]["max_abs_diff"]["token_logits"] <= TOL


def test_inspect_names_each_head_kind(bert_heads, baked, capsys):
    code, out, _ = _cli(capsys, "inspect", baked)
    assert code == 0
    assert "label_fused      fusion over alpha, beta, gamma; labels: entailment, neutral, contradiction\n" in out
    assert "score_single     adapter gamma; head regression (one value)" in out
    assert "choose_fused     fusion over alpha, beta, gamma; head multiple_choice (one logit per (context, choice) row, " \
        "trained on 3 choices)" in out  # fmt: skip
    assert f"tags_fused       fusion over alpha, beta, gamma; head tagging (per token); labels: {', '.join(TAGS)}" in out
    assert "span_single      adapter gamma; head question_answering (start and end logits per token)" in out
    code, out, _ = _cli(capsys, "inspect", bert_heads.spec)
    assert code == 0 and "head question_answering (start and end logits per token)" in out
    code, out, _ = _cli(capsys, "inspect", bert_heads.spec, "--json")
    tasks = json.loads(out)["tasks"]
    assert {t: tasks[t]["head"] for t in ALL} == {t: kind(t) for t in ALL}
    assert tasks["choose_single"]["num_choices"] == 3 and set(HEADS) <= {t.rsplit("_", 1)[0] for t in tasks}


def test_predict_on_the_spec_answers_each_kind_as_the_artifact(bert_heads, baked, capsys):
    """The PyTorch runner of a spec describes each task's head as the artifact does (a tagging task is not read as a
    classification task of five labels), so `predict` on either gives the same answers."""
    runs = {
        "score_fused": ["--text", SENTENCES[0]],
        "tags_single": ["--text", SENTENCES[1]],
        "choose_fused": ["--text", CONTEXTS[0][0], *(a for c in CONTEXTS[0][1] for a in ("--choice", c))],
    }
    for name, argv in runs.items():
        answers = []
        for model in (bert_heads.spec, baked):
            code, out, err = _cli(capsys, "predict", model, "--task", name, *argv)
            assert code == 0, err
            answers.append(json.loads(out))
        spec, art = answers
        assert spec.keys() == art.keys(), (name, spec, art)
        if name == "tags_single":
            assert spec["tokens"], spec  # some word piece is tagged other than O
            assert [{k: v for k, v in t.items() if k != "score"} for t in spec["tokens"]] == [
                {k: v for k, v in t.items() if k != "score"} for t in art["tokens"]
            ]
            assert np.allclose([t["score"] for t in spec["tokens"]], [t["score"] for t in art["tokens"]], atol=1e-4)
        elif name == "score_fused":
            assert abs(spec["score"] - art["score"]) <= TOL and "label" not in spec
        else:
            assert spec["choice"] == art["choice"] and np.allclose(spec["scores"], art["scores"], atol=1e-4)
