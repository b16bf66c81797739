"""`fusionserve predict` and `inspect` end to end, in-process, on a model AdapterHub saved."""

import json

import pytest
import torch

from fusionserve.cli.main import main
from tests.adapterhub_models import PAIRS, SENTENCES

# one worker for test_export, test_export_errors and test_cli under xdist, so that conftest's ``exported`` is exported once
# per weight format: test_export checks that its manifest names the spec of this worker's ``built``, which an export
# shared across workers (tests/made_once.py) would not
pytestmark = pytest.mark.xdist_group("exported")


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_predict_text_and_pair_match_adapterhub(built_st, capsys):
    text, pair = PAIRS[1]
    code, out, _ = _run(capsys, "predict", built_st.spec, "--task", "rte", "--text", text, "--text-pair", pair)
    assert code == 0
    row = json.loads(out)
    batch = built_st.tokenizer([text], [pair], return_tensors="pt")  # pairs encoded as pairs
    ref = built_st.reference_logits("rte", dict(batch))[0]
    assert set(row) == {"label", "scores", "logits"}
    assert list(row["scores"]) == ["entailment", "neutral", "contradiction"]
    torch.testing.assert_close(torch.tensor(row["logits"]), ref, atol=1e-4, rtol=0)
    assert row["label"] == ["entailment", "neutral", "contradiction"][int(ref.argmax())]
    assert sum(row["scores"].values()) == pytest.approx(1.0, abs=1e-5)


def test_predict_jsonl_keeps_order_reports_bad_rows_and_goes_on(built_st, capsys, tmp_path):
    lines = [json.dumps({"text": s, "id": i}) for i, s in enumerate(SENTENCES)]
    lines.insert(2, '{"text": ""}')
    lines.insert(4, "{not json")
    lines.append(json.dumps({"text": PAIRS[0][0], "text_pair": PAIRS[0][1]}))
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    code, _, err = _run(
        capsys, "predict", built_st.spec, "--task", "alpha_only", "--input", src, "--output", dst, "--batch-size", "3"
    )
    assert code == 1  # some rows failed, the others were written
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(rows) == len(lines)
    assert rows[2] == {"line": 3, "error": "'text' must be a non-empty string, got ''"}
    assert rows[4]["line"] == 5 and "not valid JSON" in rows[4]["error"]
    assert "2 of 8 inputs failed" in err
    good = [r for r in rows if "label" in r]
    assert [r.get("id") for r in good] == [0, 1, 2, 3, 4, None]
    # each row equals the reference on that sentence alone: batching and padding change nothing
    for r, s in zip(good, SENTENCES, strict=False):
        ref = built_st.reference_logits("alpha_only", dict(built_st.tokenizer([s], return_tensors="pt")))[0]
        torch.testing.assert_close(torch.tensor(r["logits"]), ref, atol=1e-4, rtol=0)


def test_predict_errors_are_clear(built_st, capsys, tmp_path):
    code, _, err = _run(capsys, "predict", built_st.spec, "--task", "nope", "--text", "hi")
    assert code == 2 and "unknown task 'nope'; known tasks: rte, nli" in err
    code, _, err = _run(capsys, "predict", built_st.spec, "--task", "rte", "--text", "  ")
    assert code == 2 and "'text' must be a non-empty string" in err
    code, _, err = _run(capsys, "predict", tmp_path / "missing.yaml", "--task", "rte", "--text", "hi")
    assert code == 2 and "spec file not found" in err
    code, _, err = _run(capsys, "predict", built_st.spec, "--task", "rte", "--input", tmp_path / "none.jsonl")
    assert code == 2 and f"input file not found: {tmp_path / 'none.jsonl'}" in err


def test_long_text_is_truncated_and_flagged(built_st, capsys):
    code, out, _ = _run(capsys, "predict", built_st.spec, "--task", "head_only", "--text", " ".join(["movie"] * 600))
    assert code == 0
    assert json.loads(out)["truncated"] is True


def test_inspect_text_and_json(built_st, capsys):
    code, out, _ = _run(capsys, "inspect", built_st.spec)
    assert code == 0
    assert "fusion over alpha, beta, gamma" in out and "L1:alpha+gamma" in out
    code, out, _ = _run(capsys, "inspect", built_st.spec, "--json")
    info = json.loads(out)
    assert info["tasks"]["rte"]["adapters_per_layer"][1] == ["alpha", "gamma"]
    assert info["adapters"]["beta"]["bottleneck_per_layer"] == {"0": 4, "2": 4}
    assert info["tasks"]["beta_only"]["labels"] == ["x", "y", "z"]
    p = info["parameters"]
    assert p["backbone"] > 0 and p["adapters"] == sum(a["parameters"] for a in info["adapters"].values())


def test_inspect_aligns_long_task_names(exported):
    import copy

    from fusionserve.serving.model.artifact import load_artifact, render_manifest

    manifest = copy.deepcopy(load_artifact(exported.folder).manifest)
    long = "a_task_name_longer_than_sixteen_characters"
    manifest["tasks"][long] = manifest["tasks"].pop(next(iter(manifest["tasks"])))
    lines = render_manifest(manifest).split("tasks\n", 1)[1].split("\n")
    rows = [line for line in lines if line.startswith("  ") and "labels:" in line]
    starts = {len(line) - len(line[2:].split(" ", 1)[1].lstrip()) for line in rows}
    assert len(rows) == len(manifest["tasks"]) and len(starts) == 1, rows


# --- outputs never touch an input (issue 30) ---------------------------------------------------------------------


def _alias(kind: str, src, tmp_path):
    """An output path that is the input itself, a symlink to it or a hard link to it."""
    if kind == "same":
        return src
    alias = tmp_path / f"{kind}.jsonl"
    (alias.symlink_to if kind == "symlink" else alias.hardlink_to)(src)
    return alias


@pytest.mark.parametrize("kind", ["same", "symlink", "hardlink"])
@pytest.mark.parametrize("command", ["predict", "score", "calibrate"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(artifact, capsys, tmp_path, command, kind):
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    before = src.read_bytes()
    dst = _alias(kind, src, tmp_path)
    code, out, err = _run(capsys, command, artifact, "--task", "rte", "--input", src, "--output", dst)
    assert src.read_bytes() == before  # nothing lost
    assert (code, out) == (2, "")
    assert err == f"fusionserve: error: --output {dst} is the input file {src}; write to another file\n"


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("{tmp}/dir.jsonl", "--output {tmp}/dir.jsonl is a folder; name a file to write"),
        ("{tmp}/no/such/out.jsonl", "--output {tmp}/no/such/out.jsonl: its folder {tmp}/no/such does not exist"),
        ("{tmp}/rows.jsonl/out.jsonl", "--output {tmp}/rows.jsonl/out.jsonl: {tmp}/rows.jsonl is not a folder"),
        ("/proc/out.jsonl", "cannot write --output /proc/out.jsonl: no file can be created in /proc"),
    ],
)
@pytest.mark.parametrize("command", ["predict", "score", "calibrate"])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(artifact, capsys, tmp_path, command, where, says):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"text": "a sentence"}) + "\n")
    (tmp_path / "dir.jsonl").mkdir()
    dst = where.format(tmp=tmp_path)
    code, out, err = _run(capsys, command, artifact, "--task", "rte", "--input", src, "--output", dst)
    assert (code, out) == (2, "")
    assert err.startswith(f"fusionserve: error: {says.format(tmp=tmp_path)}") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.jsonl", "rows.jsonl"]  # nothing written, nothing left


def test_a_side_file_of_score_that_is_the_input_is_refused(artifact, capsys, tmp_path):
    src = tmp_path / "out.jsonl.errors.jsonl"
    src.write_text(json.dumps({"text": "a sentence"}) + "\n")
    before = src.read_bytes()
    code, _, err = _run(capsys, "score", artifact, "--task", "rte", "--input", src, "--output", tmp_path / "out.jsonl")
    assert code == 2 and src.read_bytes() == before
    assert err == f"fusionserve: error: out.jsonl's side file {src} is the input file {src}; write to another file\n"


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("folder.jsonl", "input file {src} is a folder; name a file"),
        ("utf16.jsonl", "input file {src} looks UTF-16-encoded; fusionserve reads UTF-8: convert it (e.g. iconv -f UTF-16"),
        ("none.jsonl", "input file not found: {src}"),
    ],
)
@pytest.mark.parametrize("command", ["predict", "evaluate", "calibrate"])
def test_an_input_that_cannot_be_read_is_one_line_and_exit_2(artifact, capsys, tmp_path, command, name, says):
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "utf16.jsonl").write_text(json.dumps({"text": "café", "label": "x"}) + "\n", encoding="utf-16")
    src, dst = tmp_path / name, tmp_path / "out.json"
    code, out, err = _run(
        capsys, command, artifact, "--task", "rte", "--input", src, *(["--output", dst] if command != "evaluate" else [])
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"fusionserve: error: {says.format(src=src)}") and err.count("\n") == 1, err
    assert not dst.exists()


def test_predict_reports_a_latin1_line_and_a_line_over_the_limit_in_their_place_and_goes_on(artifact, capsys, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"text": s}).encode() for s in SENTENCES]
    lines[1] = '{"text": "café au lait"}'.encode("latin-1")
    lines[3] = json.dumps({"text": "word " * 100}).encode()  # 512 bytes and the line end
    src.write_bytes(b"\n".join(lines) + b"\n")
    code, _, err = _run(capsys, "predict", artifact, "--task", "rte", "--input", src, "--output", dst, "--max-row-bytes", 300)
    assert code == 1 and f"2 of {len(lines)} inputs failed" in err
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert rows[1] == {
        "line": 2,
        "error": "not valid UTF-8: byte 0xe9 at column 14; convert the file to UTF-8 (a latin-1 file: iconv -f LATIN1 -t UTF-8)",
    }
    assert rows[3] == {"line": 4, "error": "row is 513 bytes, over the limit of 300 (--max-row-bytes); left out"}
    assert len(rows) == len(lines) and all("label" in r for i, r in enumerate(rows) if i not in (1, 3))
    src.write_bytes('{"text": "a film", "label": "neutral"}\n{"text": "café", "label": "neutral"}\n'.encode("latin-1"))
    code, out, err = _run(capsys, "evaluate", artifact, "--task", "rte", "--input", src)
    assert code == 0 and "line 2: not valid UTF-8: byte 0xe9 at column 14" in err and "/1; 95% CI" in out  # one line counted


def test_predict_batches_texts_of_similar_length_and_answers_in_input_order(artifact):
    """predict runs a window of inputs in batches of similar token length, as score does (issue 38: the int8
    benchmark measured such batches while predict padded file-order batches to their longest, and int8's answers,
    whose QKV and adapter activation scales are per batch, differed): less padding, answers in input order."""
    import io

    import numpy as np

    from fusionserve.scoring.predict import predict
    from fusionserve.serving.model.predictions import TextInput
    from fusionserve.serving.model.runtime import OnnxRunner

    widths: list[int] = []

    class Recording(OnnxRunner):
        def run(self, task, encoded, return_fusion_activations=False, served=None):
            widths.append(encoded.input_ids.shape[1])
            return super().run(task, encoded, return_fusion_activations, served)

    runner = Recording(artifact, threads=1, device="cpu")
    long = " ".join(SENTENCES)
    texts = [SENTENCES[0] if i % 2 else long for i in range(8)]  # long, short, long, short, ...
    out = io.StringIO()
    assert predict(runner, "rte", iter(enumerate(TextInput(t) for t in texts)), out, batch_size=2) == (8, 0)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    short, wide = min(widths), max(widths)
    assert short < wide and widths[:4].count(wide) == 2  # two batches of the long texts, two of the short ones
    alone = {t: runner.logits("rte", [TextInput(t)])[0][0] for t in set(texts)}
    for text, row in zip(texts, rows, strict=True):
        np.testing.assert_allclose(row["logits"], alone[text], atol=1e-5)


def test_predict_raw_scores_writes_a_classification_tasks_logits_as_its_scores(artifact, capsys):
    """--raw-scores says "scores hold the model's logits instead of probabilities"; a classification task's line
    kept the probabilities (issue 38's bf16 run found it): now its scores are the logits, unrounded, as the API's
    raw_scores gives them, and the label and logits fields stay as they were."""
    code, out, _ = _run(capsys, "predict", artifact, "--task", "rte", "--text", SENTENCES[0])
    plain = json.loads(out)
    code_raw, out, _ = _run(capsys, "predict", artifact, "--task", "rte", "--text", SENTENCES[0], "--raw-scores")
    raw = json.loads(out)
    assert (code, code_raw) == (0, 0)
    assert sum(plain["scores"].values()) == pytest.approx(1.0, abs=1e-5)
    assert raw["label"] == plain["label"] and raw["logits"] == plain["logits"]
    assert list(raw["scores"]) == list(plain["scores"])
    assert list(raw["scores"].values()) == pytest.approx(raw["logits"], abs=1e-6)
    assert sum(raw["scores"].values()) != pytest.approx(1.0, abs=1e-3)
