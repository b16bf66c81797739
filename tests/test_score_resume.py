"""`fusionserve score` resumes after an interrupted or killed run to the uninterrupted run's output, with neither
duplicates nor gaps, and refuses an output that another scoring run wrote unless told to overwrite it."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusionserve.errors import InputError
from fusionserve.scoring.progress import side_files
from fusionserve.scoring.score import score_file
from tests.score_helpers import _cfg, _errors, _read, _rows_with_bad_ones, _texts, _write


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_interrupted_run_resumes_to_the_uninterrupted_output(artifact, tmp_path, fmt):
    src = _write(tmp_path / f"in.{fmt}", _rows_with_bad_ones(28))
    ref, dst = tmp_path / f"ref.{fmt}", tmp_path / f"out.{fmt}"
    score_file(_cfg(artifact, src, ref, all_scores=True))

    first = score_file(_cfg(artifact, src, dst, all_scores=True), max_rows=10)  # stops after 2 chunks of 5
    assert (first.rows, first.complete) == (10, False)
    errors, progress, parts = side_files(dst)
    # a crash in the middle of the next chunk: its output reached the disk, the progress file did not
    if fmt == "parquet":
        assert len(list(parts.glob("part-*.parquet"))) == 2
        pq.write_table(pa.table({"junk": [1]}), parts / "part-000002.parquet")
    else:
        with dst.open("a") as fh:
            fh.write('{"id": 10, "text": "the mov' if fmt == "jsonl" else "10,the mov")  # a cut last line
        with errors.open("a") as fh:
            fh.write('{"row": 12, "err')

    second = score_file(_cfg(artifact, src, dst, all_scores=True))
    assert (second.resumed_from, second.rows, second.scored, second.failed, second.complete) == (10, 28, 25, 3, True)
    if fmt == "parquet":
        assert pq.read_table(dst).equals(pq.read_table(ref)) and not parts.exists()
    else:
        assert dst.read_bytes() == ref.read_bytes()  # no duplicates, no gaps, nothing left of the cut line
    assert errors.read_bytes() == side_files(ref)[0].read_bytes()
    assert [e["row"] for e in _errors(dst)] == [4, 12, 18]

    again = score_file(_cfg(artifact, src, dst, all_scores=True))  # complete: nothing left to do
    assert (again.rows, again.resumed_from, again.complete) == (28, 28, True)
    assert json.loads(progress.read_text())["complete"] is True


@pytest.mark.slow
def test_killed_run_resumes_without_duplicates_or_gaps(artifact, tmp_path):
    src = _write(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(_texts(2000, seed=4))])
    ref, dst = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    score_file(_cfg(artifact, src, ref, chunk_size=10, batch_size=8))
    progress = side_files(dst)[1]
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "score", str(artifact), "--task", "rte", "--input", str(src),
           "--output", str(dst), "--chunk-size", "10", "--batch-size", "8", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if progress.exists() and json.loads(progress.read_text() or "{}").get("rows_done", 0) >= 50:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed; give it more rows"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    done = json.loads(progress.read_text())["rows_done"]
    assert 50 <= done < 2000 and done % 10 == 0

    resumed = score_file(_cfg(artifact, src, dst, chunk_size=10, batch_size=8))
    assert (resumed.resumed_from, resumed.rows, resumed.complete) == (done, 2000, True)
    assert dst.read_bytes() == ref.read_bytes()


def test_an_output_of_another_run_is_refused_unless_overwrite(artifact, tmp_path):
    src = _write(tmp_path / "in.jsonl", [{"text": t} for t in _texts(7)])
    dst = tmp_path / "out.jsonl"
    score_file(_cfg(artifact, src, dst), max_rows=5)
    with pytest.raises(InputError, match=r"written by a different scoring run \(task: 'rte' then, 'nli' now\); pass --overwrite"):
        score_file(_cfg(artifact, src, dst, task="nli"))
    with pytest.raises(InputError, match=r"--all-scores: False then, True now"):
        score_file(_cfg(artifact, src, dst, all_scores=True))
    _write(src, [{"text": t} for t in _texts(7, seed=9)])  # same path, other rows
    with pytest.raises(InputError, match=r"input \(sha256\): '[0-9a-f]{12}' then, '[0-9a-f]{12}' now"):
        score_file(_cfg(artifact, src, dst))
    fresh = score_file(_cfg(artifact, src, dst, task="nli", overwrite=True))
    assert (fresh.resumed_from, fresh.rows, fresh.complete) == (0, 7, True)
    assert {r["label"] for r in _read(dst)} <= {"yes", "no"}

    other = tmp_path / "mine.jsonl"
    other.write_text("precious\n")
    with pytest.raises(InputError, match="exists and was not written by `fusionserve score`"):
        score_file(_cfg(artifact, src, other))
    assert other.read_text() == "precious\n"


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
@pytest.mark.parametrize("damage", ["cut", "edited", "deleted"])
def test_a_finished_output_that_was_cut_or_changed_is_not_called_complete(artifact, tmp_path, fmt, damage):
    src = _write(tmp_path / f"in.{fmt}", [{"text": t} for t in _texts(12)])
    dst = tmp_path / f"out.{fmt}"
    assert score_file(_cfg(artifact, src, dst)).complete
    data = dst.read_bytes()
    if damage == "cut":
        dst.write_bytes(data[: len(data) // 2])
    elif damage == "edited":
        dst.write_bytes(data.replace(b"a", b"b", 1) if b"a" in data else data + b"\n")
    else:
        dst.unlink()
    with pytest.raises(
        InputError, match=r"was finished by an earlier run with 12 scored rows in \d+ bytes, but it .*--overwrite"
    ):
        score_file(_cfg(artifact, src, dst))
    assert score_file(_cfg(artifact, src, dst, overwrite=True)).scored == 12
