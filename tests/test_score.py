"""`fusionserve score`: JSONL / CSV / Parquet in and out on a tiny exported artifact (real ONNX Runtime sessions), the
same predictions as OnnxRunner row by row, length-sorted batches put back in order, bad rows in the side file and
clear errors. Resuming is in test_score_resume.py, the Ray Data path in test_score_ray.py."""

import csv
import datetime as dt
import io
import json

import numpy as np
import pytest

from fusionserve.cli.main import main
from fusionserve.errors import InputError
from fusionserve.scoring.core import mean_activations, score_inputs
from fusionserve.scoring.progress import side_files
from fusionserve.scoring.score import score_file
from fusionserve.serving.model.predictions import TextInput, label_scores
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS
from tests.runtime_helpers import MAX_SEQ_LEN
from tests.score_helpers import _cfg, _errors, _read, _texts, _write


@pytest.fixture(scope="module")
def runner(artifact) -> OnnxRunner:
    return OnnxRunner(artifact, device="cpu")


def _one_by_one(runner: OnnxRunner, task: str, inputs: list[TextInput]) -> list[tuple[str, float, dict[str, float]]]:
    labels = runner.labels[task]
    return [label_scores(labels, runner.run(task, runner.encoder.encode([x])).logits)[0] for x in inputs]


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# --- round trips ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_round_trip_keeps_columns_and_order_and_matches_the_runner(artifact, runner, tmp_path, fmt):
    texts = _texts(23)
    texts[4] = 'a "quoted", comma\nand a line break'  # CSV quoting, kept as it was
    when = dt.datetime(2024, 5, 1, 12, 30)
    rows = [{"id": f"00{i}" if fmt == "csv" else i, "text": t, "when": when} for i, t in enumerate(texts)]
    if fmt != "parquet":
        rows = [{**r, "when": r["when"].isoformat()} for r in rows]
    src = _write(tmp_path / f"in.{fmt}", rows)
    dst = tmp_path / f"out.{fmt}"
    summary = score_file(_cfg(artifact, src, dst))
    assert (summary.rows, summary.scored, summary.failed, summary.complete) == (23, 23, 0, True)
    assert summary.truncated == sum(len(t.split()) > MAX_SEQ_LEN - 2 for t in texts) > 0
    out = _read(dst)
    assert [list(r) for r in out] == [["id", "text", "when", "label", "score"]] * 23
    assert [{k: r[k] for k in ("id", "text", "when")} for r in out] == rows  # input kept as it was, in order
    expected = _one_by_one(runner, "rte", [TextInput(t) for t in texts])
    for r, (label, score, _) in zip(out, expected, strict=True):
        assert r["label"] == label
        assert float(r["score"]) == pytest.approx(score, abs=2e-6)
    assert not side_files(dst)[0].exists() and not side_files(dst)[2].exists()


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), [("jsonl", "parquet"), ("parquet", "csv"), ("csv", "jsonl")])
def test_output_format_follows_the_output_extension(artifact, tmp_path, src_fmt, dst_fmt):
    rows = [{"id": i, "text": t} for i, t in enumerate(_texts(6))]
    src = _write(tmp_path / f"in.{src_fmt}", rows)
    dst = tmp_path / f"out.{dst_fmt}"
    score_file(_cfg(artifact, src, dst, prefix="p_"))
    out = _read(dst)
    assert [r["text"] for r in out] == [r["text"] for r in rows]
    assert [str(r["id"]) for r in out] == [str(r["id"]) for r in rows]
    assert all(set(r) == {"id", "text", "p_label", "p_score"} for r in out)


def test_all_scores_activations_and_pairs(artifact, runner, tmp_path):
    rows = [{"a": a, "b": b} for a, b in PAIRS * 3]
    src = _write(tmp_path / "pairs.jsonl", rows)
    dst = tmp_path / "out.jsonl"
    score_file(_cfg(artifact, src, dst, text_field="a", pair_field="b", all_scores=True, activations=True))
    out = _read(dst)
    labels = runner.labels["rte"]
    assert list(out[0]) == [
        "a",
        "b",
        "label",
        "score",
        *(f"score_{x}" for x in labels),
        *(f"activation_{x}" for x in ("alpha", "beta", "gamma")),
    ]
    for r, (a, b) in zip(out, PAIRS * 3, strict=True):
        enc = runner.encoder.encode([TextInput(a, b)])  # pairs are encoded as pairs
        res = runner.run("rte", enc, return_fusion_activations=True)
        label, score, scores = label_scores(labels, res.logits)[0]
        assert (r["label"], r["score"]) == (label, pytest.approx(score, abs=2e-6))
        assert [r[f"score_{x}"] for x in labels] == pytest.approx(list(scores.values()), abs=2e-6)
        acts = res.fusion_activations[0]  # (layers, seq, adapters): one row, no padding
        assert [r[f"activation_{x}"] for x in ("alpha", "beta", "gamma")] == pytest.approx(acts.mean(axis=(0, 1)), abs=2e-6)
        assert sum(r[f"activation_{x}"] for x in ("alpha", "beta", "gamma")) == pytest.approx(1.0, abs=1e-5)


def test_raw_scores_and_left_truncation_from_the_command_line(artifact, runner, tmp_path, capsys):
    texts = _texts(12, seed=5)
    assert max(runner.encoder.count_tokens([TextInput(t) for t in texts])) > MAX_SEQ_LEN  # some are cut
    src = _write(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    dst = tmp_path / "out.jsonl"
    code, _, err = _cli(capsys, "score", artifact, "--task", "rte", "--input", src, "--output", dst, "--all-scores",
                        "--raw-scores", "--truncation-direction", "left")  # fmt: skip
    assert code == 0, err
    labels = runner.labels["rte"]
    for row, text in zip(_read(dst), texts, strict=True):
        logits = runner.run("rte", runner.encoder.encode([TextInput(text)], "left")).logits[0]
        assert [row[f"score_{x}"] for x in labels] == pytest.approx(logits.tolist(), abs=1e-5)  # logits, not probabilities
        assert row["label"] == labels[int(np.argmax(logits))] and row["score"] == pytest.approx(float(logits.max()), abs=1e-5)
    with pytest.raises(SystemExit) as exit_:
        _cli(capsys, "score", artifact, "--task", "rte", "--input", src, "--truncation-direction", "up")
    assert exit_.value.code == 2 and "invalid choice: 'up'" in capsys.readouterr().err


def test_mean_activations_ignore_padding():
    acts = np.zeros((2, 1, 3, 2))  # (batch, layers, seq, adapters)
    acts[:, :, :, 0] = 1.0
    acts[1, :, 2] = [0.0, 1.0]  # a padding position of row 1 that must not count
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    np.testing.assert_allclose(mean_activations(acts, mask), [[1.0, 0.0], [1.0, 0.0]])


class _Recording(OnnxRunner):
    """The real runner, noting the padded length of every batch it runs."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lengths: list[int] = []

    def run(self, task, encoded, return_fusion_activations=False):
        self.lengths.append(encoded.input_ids.shape[1])
        return super().run(task, encoded, return_fusion_activations)


def test_rows_of_an_encoded_chunk_equal_encoding_those_rows_alone(runner):
    inputs = [TextInput(t) for t in _texts(12, seed=2)] + [TextInput(a, b) for a, b in PAIRS]
    chunk = runner.encoder.encode(inputs)
    for idx in ([0], [3, 1, 7], [len(inputs) - 1, 0], list(range(len(inputs)))):
        alone, part = runner.encoder.encode([inputs[i] for i in idx]), chunk.rows(idx)
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            np.testing.assert_array_equal(getattr(part, key), getattr(alone, key), err_msg=f"{idx}: {key}")
        assert part.truncated == alone.truncated


def test_length_sorted_batches_pad_less_and_results_stay_in_input_order(artifact, runner):
    inputs = [TextInput(t) for t in _texts(30, seed=1)]
    rec = _Recording(artifact, device="cpu")
    got = score_inputs(rec, "nli", inputs, batch_size=4)
    assert rec.lengths == sorted(rec.lengths) and len(rec.lengths) == 8
    unsorted = [runner.encoder.encode(inputs[i : i + 4]).input_ids.shape[1] for i in range(0, 30, 4)]
    assert sum(rec.lengths) < sum(unsorted)
    expected = _one_by_one(runner, "nli", inputs)
    assert [g.label for g in got] == [e[0] for e in expected]
    assert [g.score for g in got] == pytest.approx([e[1] for e in expected], abs=2e-6)


# --- bad rows and errors ----------------------------------------------------------------------------------------


def test_bad_rows_go_to_the_side_file_and_the_job_goes_on(artifact, tmp_path, capsys):
    lines = [
        json.dumps({"id": 1, "text": "the movie was great"}),
        json.dumps({"id": 2}),
        "",  # blank: skipped, still counted as a line
        json.dumps({"id": 4, "text": 7}),
        json.dumps({"id": 5, "text": "   "}),
        "{not json",
        json.dumps(["text", "a list"]),
        json.dumps({"id": 8, "text": None}),
        json.dumps({"id": 9, "text": "the cat sat", "label": "pos"}),
        json.dumps({"id": 10, "text": "a bad plot"}),
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "out.jsonl"
    code, out, err = _cli(capsys, "score", artifact, "--task", "nli", "--input", src, "--output", dst, "--chunk-size", 4)
    assert code == 1  # like predict: some rows were bad, the others are written
    assert "scored 2 of 9 rows" in out and "7 bad rows listed in" in out
    assert "row 2: missing field 'text'" in err
    assert [r["id"] for r in _read(dst)] == [1, 10]
    errors = _errors(dst)
    assert [e["row"] for e in errors] == [2, 4, 5, 6, 7, 8, 9]
    reasons = [e["error"] for e in errors]
    assert reasons[:3] == [
        "missing field 'text'",
        "field 'text' must be a string, got number 7",
        "field 'text' is only whitespace",
    ]
    assert reasons[3].startswith("not valid JSON") and reasons[4] == "expected a JSON object, got array"
    assert reasons[5] == "field 'text' is null" and "--prefix" in reasons[6]

    bad_csv = tmp_path / "in.csv"
    bad_csv.write_text("id,text\n1,the movie was great\n2,\n3,a,b\n4,boring\n")
    code, _, _ = _cli(capsys, "score", artifact, "--task", "nli", "--input", bad_csv)  # default output: in.scored.csv
    assert code == 1
    assert [r["id"] for r in _read(tmp_path / "in.scored.csv")] == ["1", "4"]
    assert _errors(tmp_path / "in.scored.csv") == [
        {"row": 2, "error": "field 'text' is empty"},
        {"row": 3, "error": "has 3 field(s), the header has 2"},
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_rows_over_the_size_limit_or_not_utf8_are_bad_rows_at_their_own_row_and_the_job_goes_on(artifact, tmp_path, capsys, fmt):
    rows = [{"id": i, "text": t} for i, t in enumerate(_texts(60, seed=3))]  # more than one 8 KB decoding block
    rows[7]["text"] = "long " * 100  # 500 bytes: over --max-row-bytes 400
    src = _write(tmp_path / f"in.{fmt}", rows)
    if fmt != "parquet":  # a latin-1 byte in row 50 (a CSV field with a line break before it: rows are not lines)
        data = src.read_bytes().replace(rows[49]["text"].encode(), b'"caf\xe9\nau lait"' if fmt == "csv" else b"caf\xe9")
        src.write_bytes(data.replace(rows[20]["text"].encode(), b'"two\nlines"' if fmt == "csv" else b"two lines"))
    dst = tmp_path / f"out.{fmt}"
    code, out, _ = _cli(capsys, "score", artifact, "--task", "rte", "--input", src, "--output", dst, "--max-row-bytes", 400)
    assert code == 1 and f"scored {58 if fmt != 'parquet' else 59} of 60 rows" in out
    size = {"jsonl": len(json.dumps(rows[7]) + "\n"), "csv": len(f"7,{rows[7]['text']}\r\n"), "parquet": 500}[fmt]
    errors = _errors(dst)
    assert errors[0] == {"row": 8, "error": f"row is {size} bytes, over the limit of 400 (--max-row-bytes); left out"}
    if fmt != "parquet":
        col = len('{"id": 49, "text": "caf') + 1 if fmt == "jsonl" else 4
        field = "field 2: " if fmt == "csv" else ""
        assert errors[1] == {
            "row": 50,
            "error": f"{field}not valid UTF-8: byte 0xe9 at column {col}; convert the file to UTF-8 (a latin-1 file: iconv -f LATIN1 -t UTF-8)",
        }
    left_out = (7,) if fmt == "parquet" else (7, 49)
    assert [r["id"] for r in _read(dst)] == [str(r["id"]) if fmt == "csv" else r["id"] for r in rows if r["id"] not in left_out]


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
def test_csv_rows_end_in_any_line_end_and_a_quoted_field_may_hold_one(artifact, tmp_path, capsys, end):
    src = tmp_path / "in.csv"
    src.write_bytes(f'id,text{end}1,a fine film{end}2,"two{end}lines"{end}3,caf\xe9{end}4,a dull film{end}'.encode("latin-1"))
    code, out, _ = _cli(capsys, "score", artifact, "--task", "rte", "--input", src, "--output", tmp_path / "out.csv")
    assert code == 1 and "scored 3 of 4 rows" in out
    written = (tmp_path / "out.csv").read_bytes().decode()  # not _read: read_text() would turn the field's \r into \n
    texts = [r[1] for r in csv.reader(io.StringIO(written, newline=""))][1:]
    assert texts == ["a fine film", f"two{end}lines", "a dull film"]  # a field's lone \r is quoted too
    assert [e["row"] for e in _errors(tmp_path / "out.csv")] == [3]


@pytest.mark.parametrize(
    ("make", "args", "says"),
    [
        ("in.csv", ["--text-field", "body"], "--text-field 'body' not found in {src}; columns: id, text"),
        (
            "in.jsonl",
            ["--text-field", "body"],
            "--text-field 'body' not found in the first 3 rows of {src}; fields seen: id, text",
        ),
        ("in.parquet", ["--pair-field", "id"], "--pair-field 'id' of {src} is a int64 column; it must hold strings"),
        ("in.txt", [], "cannot tell the format of {src} from its extension '.txt'; known: .jsonl"),
        ("in.csv", ["--output", "{tmp}/out.xlsx"], "cannot tell the format of {tmp}/out.xlsx from its extension '.xlsx'"),
        ("in.csv", ["--task", "nope"], "unknown task 'nope'; known tasks: rte, nli"),
        ("in.csv", ["--task", "alpha_only", "--activations"], "--activations: task 'alpha_only' has no fusion layer"),
        (
            "in.csv",
            ["--prefix", "", "--input", "{tmp}/labelled.csv"],
            "{tmp}/labelled.csv already has 'label'; pass --prefix (e.g. --prefix pred_)",
        ),
        ("in.csv", ["--input", "{tmp}/none.jsonl"], "input file not found: {tmp}/none.jsonl"),
        ("in.csv", ["--input", "{tmp}/folder.csv"], "input file {tmp}/folder.csv is a folder; name a file"),
        ("in.csv", ["--input", "{tmp}/utf16.csv"], "input file {tmp}/utf16.csv looks UTF-16-encoded; fusionserve reads UTF-8"),
        ("in.jsonl", ["--input", "{tmp}/utf16.jsonl"], "input file {tmp}/utf16.jsonl looks UTF-16-encoded; fusionserve"),
        ("in.csv", ["--max-row-bytes", "0"], "--max-row-bytes must be at least 1, got 0"),
        ("in.csv", ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    ],
)
def test_fatal_errors_are_clear_and_exit_2(artifact, tmp_path, capsys, make, args, says):
    rows = [{"id": i, "text": t} for i, t in enumerate(_texts(3))]
    src = tmp_path / make
    if src.suffix == ".txt":
        src.write_text("hello\n")
    else:
        _write(src, rows)
    _write(tmp_path / "labelled.csv", [{**r, "label": "x"} for r in rows])
    (tmp_path / "folder.csv").mkdir()
    for name in ("utf16.csv", "utf16.jsonl"):  # what a Windows editor saves as "Unicode"
        (tmp_path / name).write_text(_write(tmp_path / name, rows).read_text(), encoding="utf-16")
    out = tmp_path / f"out{src.suffix}"
    extra = [a.format(tmp=tmp_path) for a in args]  # argparse keeps the last of a repeated option
    code, _, err = _cli(capsys, "score", artifact, "--task", "rte", "--input", src, "--output", out, *extra)
    assert code == 2
    assert f"fusionserve: error: {says.format(src=src, tmp=tmp_path)}" in err
    assert not out.exists() and not side_files(out)[1].exists()  # nothing written


def test_spec_instead_of_artifact_is_refused(built_st, tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"text": "hi"}])
    code, _, err = _cli(capsys, "score", built_st.spec, "--task", "rte", "--input", src)
    assert code == 2 and "is not an artifact folder" in err and "fusionserve export" in err


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_several_tasks_add_their_columns_in_one_pass(artifact, runner, tmp_path, fmt):
    texts = _texts(11)
    src = _write(tmp_path / f"in.{fmt}", [{"id": str(i), "text": t} for i, t in enumerate(texts)])
    dst = tmp_path / f"out.{fmt}"
    tasks = ("nli", "alpha_only", "head_only")
    summary = score_file(_cfg(artifact, src, dst, task=tasks, all_scores=True))
    assert (summary.rows, summary.scored, summary.complete) == (11, 11, True)
    out = _read(dst)
    expected = ["id", "text"]
    for task in tasks:
        expected += [f"{task}_label", f"{task}_score", *(f"{task}_score_{lab}" for lab in runner.labels[task])]
    assert list(out[0]) == expected
    for task in tasks:
        want = [label for label, _, _ in label_scores(runner.labels[task], runner.logits(task, [TextInput(t) for t in texts])[0])]
        assert [r[f"{task}_label"] for r in out] == want, task
    with pytest.raises(InputError, match="--task: 'nli' named more than once"):
        score_file(_cfg(artifact, src, tmp_path / f"again.{fmt}", task=("nli", "nli")))
    with pytest.raises(InputError, match="--activations: task 'alpha_only' has no fusion layer"):
        score_file(_cfg(artifact, src, tmp_path / f"acts.{fmt}", task=("nli", "alpha_only"), activations=True))


def test_repeated_task_option_adds_each_tasks_columns_as_its_own_run(artifact, tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(_texts(9))])
    argv = ["--input", src, "--all-scores", "--activations", "--batch-size", 4, "--prefix", "p_"]
    code, out, _ = _cli(capsys, "score", artifact, "--task", "rte", "--task", "nli", "--output", tmp_path / "both.jsonl", *argv)
    assert code == 0 and "scored 9 of 9 rows" in out
    got = _read(tmp_path / "both.jsonl")
    columns = ["id", "text"]
    for task in ("rte", "nli"):
        assert _cli(capsys, "score", artifact, "--task", task, "--output", tmp_path / f"{task}.jsonl", *argv)[0] == 0
        alone = _read(tmp_path / f"{task}.jsonl")
        added = list(alone[0])[2:]  # p_label, p_score, p_score_<label>..., p_activation_<adapter>...
        assert added[:2] == ["p_label", "p_score"] and len(added) > 4
        columns += [f"p_{task}_{name.removeprefix('p_')}" for name in added]  # the prefix, then the task
        for g, a in zip(got, alone, strict=True):  # one pass over the file: each task's values as in its own run
            assert {name: g[f"p_{task}_{name.removeprefix('p_')}"] for name in added} == {name: a[name] for name in added}
    assert [list(r) for r in got] == [columns] * 9
