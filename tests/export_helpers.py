"""Shared by the export tests (test_export.py, test_export_errors.py): the settings of the tiny model's export (the
``exported`` fixture in conftest.py) and running the command line."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionserve.cli.main import main

MAX_SEQ_LEN = 64  # the parity grid then runs sequences 5 and 37
ARCH_MAX_SEQ_LEN = 40  # every backbone's tiny model covers 64 tokens; the grid runs 5 and 37
OPSET = 17


@dataclass(frozen=True)
class Exported:
    folder: Path
    manifest: dict[str, Any]  # what export_artifact returned


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err
