"""Which runner a model argument means: an artifact folder runs on ONNX Runtime, a spec file on the PyTorch model
(the only path from the CLI into the torch half at run time)."""

from __future__ import annotations

from pathlib import Path

from fusionserve.errors import InputError
from fusionserve.serving.model.artifact import MANIFEST, is_artifact
from fusionserve.serving.model.runner import ActivationRunner


def open_runner(model: str) -> ActivationRunner:
    """An artifact folder runs on ONNX Runtime; a spec file on the PyTorch model (needs the [export] extra).
    Raises InputError for a folder that is not an artifact, and what the runner raises for a bad model."""
    path = Path(model)
    if is_artifact(path):
        from fusionserve.serving.model.runtime import OnnxRunner

        return OnnxRunner(path)
    if path.is_dir():
        raise InputError(f"{model} is a folder without {MANIFEST}: give an artifact folder (`fusionserve export`) or a spec file")
    from fusionserve.export.predict import TorchRunner  # torch only when a spec is given

    return TorchRunner(path)
