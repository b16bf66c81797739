"""Shared by the scoring tests (test_score.py, test_score_resume.py, test_score_ray.py): input rows, writing and
reading them in each format, the side file of bad rows, and a ScoreConfig on the tiny artifact (the ``artifact``
fixture in conftest.py, exported with runtime_helpers.MAX_SEQ_LEN tokens)."""

import csv
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from fusionserve.scoring.config import ScoreConfig
from fusionserve.scoring.progress import side_files
from tests.adapterhub_models import WORDS


def _texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of 1 to 40 words (some past the 32-token limit), lengths shuffled."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, 40))) for _ in range(n)]


def _cfg(artifact: Path, src: Path, dst: Path, **kw) -> ScoreConfig:
    kw.setdefault("task", "rte")
    kw.setdefault("chunk_size", 5)
    kw.setdefault("batch_size", 3)
    return ScoreConfig(model=artifact, input=src, output=dst, progress=False, **kw)


def _write(path: Path, rows: list[dict]) -> Path:
    """``rows`` in the format of ``path``'s extension (CSV: every value as its string)."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return path


def _read(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(path.read_text(), newline="")))
    return pq.read_table(path).to_pylist()


def _errors(dst: Path) -> list[dict]:
    path = side_files(dst)[0]
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rows_with_bad_ones(n: int) -> list[dict]:
    rows: list[dict] = [{"id": i, "text": t} for i, t in enumerate(_texts(n, seed=2))]
    for i in (3, 11, 17):
        rows[i]["text"] = " "
    return rows
