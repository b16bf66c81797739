"""Shared by the export tests (test_export.py, test_export_errors.py, test_backbones*.py): the settings of the tiny
model's export (the ``exported`` fixture in conftest.py), each backbone's fp32 export made once (``arch_exported``),
running the command line, and the default int8 export that test_int8.py and test_int8_rowwise.py check and
test_int8_serving.py serves."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusionserve.cli.main import main
from tests.made_once import export_once

MAX_SEQ_LEN = 64  # the parity grid then runs sequences 5 and 37
ARCH_MAX_SEQ_LEN = 40  # every backbone's tiny model covers 64 tokens; the grid runs 5 and 37
OPSET = 17


@dataclass(frozen=True)
class Exported:
    folder: Path
    manifest: dict[str, Any]  # what export_artifact returned


def arch_export(tmp_path_factory: Any, spec: Path, arch: str, adapter_config: str) -> Path:
    """The fp32 export of backbone_models' ``arch`` x ``adapter_config`` model (``spec``), made once per test run
    (tests/made_once.py) and only read: conftest's ``arch_exported`` and the command-line tests of test_backbones*."""
    return export_once(tmp_path_factory, f"arch-{arch}-{adapter_config}", spec, max_seq_len=ARCH_MAX_SEQ_LEN)


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def default_int8(spec: Path, max_seq_len: int, tmp_path_factory: Any) -> tuple[Path, dict[str, Any]]:
    """``export_artifact(spec, FOLDER, "int8", max_seq_len)`` with the default Int8Options: the folder and (a copy of)
    the manifest it wrote. Once per test run (tests/made_once.py): the int8 test modules that check or serve the default
    export read the same folder (read only) instead of exporting it again, whichever worker they run on."""
    folder = export_once(tmp_path_factory, "int8", spec, precision="int8", max_seq_len=max_seq_len)
    return folder, json.loads((folder / "manifest.json").read_text())
