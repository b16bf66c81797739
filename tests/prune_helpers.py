"""Shared by test_calibrate_evaluate.py and test_prune.py (and the ``stats`` fixture in conftest.py): input files of
the tiny model's sentences and running the command line."""

import json
from pathlib import Path

from fusionserve.cli.main import main
from tests.adapterhub_models import PAIRS, SENTENCES

MAX_SEQ_LEN = 64


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _texts(path: Path) -> Path:
    rows = [{"text": s} for s in SENTENCES] + [{"text": a, "text_pair": b} for a, b in PAIRS]
    return _jsonl(path, rows * 3)
