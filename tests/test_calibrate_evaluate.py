"""calibrate and evaluate: activation statistics equal the model's own activations over real tokens, on the spec
and on an exported artifact; a task without a fusion is refused; evaluate counts correct predictions and reports bad
lines. The statistics (the ``stats`` fixture in conftest.py) are what test_prune.py prunes with."""

import json

import numpy as np
import pytest

from fusionserve.errors import FusionServeError
from fusionserve.scoring.calibrate import calibrate
from fusionserve.scoring.evaluate import evaluate
from fusionserve.scoring.inputs import read_labelled_jsonl
from fusionserve.serving.model.activations import load_stats
from fusionserve.serving.model.predictions import TextInput
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS
from tests.prune_helpers import MAX_SEQ_LEN, _cli, _jsonl, _texts

# --- calibrate -------------------------------------------------------------------------------------------------


def test_calibration_is_the_mean_and_spread_of_the_activations_over_real_tokens(spec_runner, stats):
    doc = load_stats(stats)
    inputs = [TextInput(s) for s in SENTENCES] + [TextInput(a, b) for a, b in PAIRS]
    for task in ("rte", "nli"):
        weights = []  # every real token's softmax weights: (layers, adapters) each
        for batch in (inputs[:4], inputs[4:]):  # batch 4, as calibrated: padding must not count
            enc = spec_runner.encoder.encode(batch)
            acts = spec_runner.run(task, enc, return_fusion_activations=True).fusion_activations
            for b, row in enumerate(enc.attention_mask):
                weights += [acts[b, :, t] for t in np.flatnonzero(row)]
        w = np.stack(weights * 3)  # the file holds the inputs three times
        t = doc["tasks"][task]
        assert t["tokens"] == len(w) and t["examples"] == 3 * len(inputs)
        np.testing.assert_allclose(t["mean"], w.mean(0), atol=2e-6)
        np.testing.assert_allclose(t["std"], w.std(0), atol=2e-6)
        assert t["adapters"] == TASKS[task][1]
        # beta is left out of layer 1: absent there, and the others' weights sum to one in every layer
        assert t["adapters_per_layer"][1] == [a for a in TASKS[task][1] if a != "beta"]
        np.testing.assert_allclose(np.sum(t["mean"], axis=1), 1.0, atol=1e-5)
        assert np.ptp(t["mean"]) > 0.05


def test_calibrate_cli_on_an_artifact_equals_the_spec_and_reports_bad_lines(built_st, stats, tmp_path, capsys):
    art = tmp_path / "art"
    assert _cli(capsys, "export", built_st.spec, "--out", art, "--max-seq-len", MAX_SEQ_LEN)[0] == 0
    src = _texts(tmp_path / "in.jsonl")
    src.write_text(src.read_text() + '{"text": ""}\nnot json\n{"text": "the cat", "label": "any"}\n')
    out = tmp_path / "s.json"
    code, printed, err = _cli(capsys, "calibrate", art, "--task", "rte", "--input", src, "--output", out)
    assert code == 0, err
    assert "line 25: 'text' must be a non-empty string" in err and "line 26: not valid JSON" in err
    assert "2 line(s) of" in err
    assert printed.startswith("rte: ") and f"wrote {out} and {out.with_suffix('.png')}" in printed
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    got, want = load_stats(out)["tasks"]["rte"], load_stats(stats)["tasks"]["rte"]
    assert got["tokens"] == want["tokens"] + 4  # "[CLS] the cat [SEP]": labelled lines count, labels are ignored
    np.testing.assert_allclose(got["mean"], want["mean"], atol=0.02)


@pytest.mark.parametrize("task", ["alpha_only", "head_only"])
def test_calibrating_a_task_without_fusion_is_refused(spec_runner, tmp_path, task):
    with pytest.raises(FusionServeError, match=f"task '{task}' has no fusion layer"):
        calibrate(spec_runner, [task], read_labelled_jsonl(_texts(tmp_path / "in.jsonl"), False))


# --- evaluate --------------------------------------------------------------------------------------------------


def test_evaluate_counts_correct_predictions_and_reports_bad_lines(built_st, spec_runner, tmp_path, capsys):
    labels = TASKS["rte"][3]
    inputs = [TextInput(s) for s in SENTENCES] + [TextInput(a, b) for a, b in PAIRS]
    predicted = np.argmax(spec_runner.logits("rte", inputs)[0], axis=-1)
    # label the first five as predicted and the rest as something else: accuracy 5 of 8
    rows = [{"text": i.text, **({"text_pair": i.text_pair} if i.text_pair else {}),
             "label": labels[p] if k < 5 else labels[(p + 1) % 3]} for k, (i, p) in enumerate(zip(inputs, predicted, strict=True))]  # fmt: skip
    rows += [{"text": "the cat"}, {"text": "the dog", "label": "maybe"}, {"text": "", "label": "neutral"}]
    src = _jsonl(tmp_path / "labelled.jsonl", rows)
    result = evaluate(spec_runner, "rte", read_labelled_jsonl(src, True), batch_size=3)
    assert (result.examples, result.correct) == (8, 5) and result.accuracy == 62.5
    assert sum(n for n, _ in result.per_label.values()) == 8
    assert [no for no, _ in result.bad] == [9, 10, 11]
    assert "missing field 'label'" in result.bad[0][1] and "label 'maybe' is not one of task 'rte''s labels" in result.bad[1][1]
    low, high = result.ci95
    assert low < 62.5 < high

    code, out, err = _cli(capsys, "evaluate", built_st.spec, "--task", "rte", "--input", src)
    assert code == 0 and out.startswith("rte: accuracy 62.50% (5/8; 95% CI") and "3 line(s) of" in err
    code, out, _ = _cli(capsys, "evaluate", built_st.spec, "--task", "rte", "--input", src, "--json")
    assert json.loads(out)["accuracy"] == 62.5
    code, _, err = _cli(
        capsys, "evaluate", built_st.spec, "--task", "rte", "--input", _jsonl(tmp_path / "x.jsonl", [{"text": "a"}])
    )
    assert code == 2 and "no usable labelled line to evaluate task 'rte' on (1 bad line(s))" in err
