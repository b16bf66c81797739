"""`fusionserve score --ray`: the Ray Data path gives the local path's output, bad rows included, and does not
resume a run it did not finish."""

import json

import pyarrow.parquet as pq
import pytest

from fusionserve.errors import InputError
from fusionserve.scoring.progress import side_files
from fusionserve.scoring.score import score_file
from tests.score_helpers import _cfg, _rows_with_bad_ones, _write

pytestmark = pytest.mark.xdist_group("local_ray")  # with test_heads_files: one Ray start for both (conftest.local_ray)


@pytest.mark.slow
def test_ray_data_path_gives_the_local_output(artifact, tmp_path, local_ray):
    jsonl = tmp_path / "in.jsonl"
    long = {"id": 99, "text": "long " * 100}  # over max_row_bytes: a bad row read through, either way
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in [*_rows_with_bad_ones(23), long]) + "{not json\n")
    parquet = _write(tmp_path / "in.parquet", [*_rows_with_bad_ones(19), long])
    csv = _write(tmp_path / "in.csv", [*_rows_with_bad_ones(19), long, {"id": 100, "text": "café"}])
    csv.write_bytes(csv.read_bytes().replace("café".encode(), "café".encode("latin-1")))  # not UTF-8
    for src in (jsonl, parquet, csv):
        local, remote = tmp_path / f"local{src.suffix}", tmp_path / f"ray{src.suffix}"
        # the default pool, one actor per CPU (two), on the JSONL input: the output order across actors is checked
        # there; one actor on Parquet and CSV, whose reading and parsing are what differ, and on the several-task run
        # below, whose columns are (each actor is a Ray worker that imports the scorer and loads an ONNX Runtime session)
        actors = None if src is jsonl else 1
        a = score_file(_cfg(artifact, src, local, activations=True, max_row_bytes=400))
        b = score_file(_cfg(artifact, src, remote, activations=True, max_row_bytes=400, ray=True, ray_actors=actors))
        assert a.failed >= 4 and "over the limit of 400" in side_files(local)[0].read_text()
        assert (b.rows, b.scored, b.failed, b.complete) == (a.rows, a.scored, a.failed, True)
        assert (
            remote.read_bytes() == local.read_bytes()
            if src.suffix != ".parquet"
            else pq.read_table(remote).equals(pq.read_table(local))
        )
        assert side_files(remote)[0].read_bytes() == side_files(local)[0].read_bytes()
    several = {"task": ("rte", "alpha_only"), "all_scores": True}  # several tasks: their columns, the same either way
    a = score_file(_cfg(artifact, jsonl, tmp_path / "local-2.jsonl", **several))
    b = score_file(_cfg(artifact, jsonl, tmp_path / "ray-2.jsonl", ray=True, ray_actors=1, **several))
    assert (b.scored, b.failed) == (a.scored, a.failed)
    assert (tmp_path / "ray-2.jsonl").read_bytes() == (tmp_path / "local-2.jsonl").read_bytes()
    unfinished = tmp_path / "unfinished.jsonl"
    score_file(_cfg(artifact, jsonl, unfinished), max_rows=5)
    with pytest.raises(InputError, match=r"--ray does not resume.*rerun without --ray to finish it"):
        score_file(_cfg(artifact, jsonl, unfinished, ray=True))
