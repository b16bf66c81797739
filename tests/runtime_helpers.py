"""Shared by the runtime tests (test_runtime.py, on CPU) and the GPU tests (test_gpu.py): the tiny model exported at
both precisions (the ``artifacts`` fixture in conftest.py), the batches they run, and how two runs are compared."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS

# the tiny model's shared artifacts (conftest ``artifact``, ``artifacts``): parity grid at export sequence 5 only,
# buckets 16 and 32; scoring and the servers of the end-to-end tests use the fp32 one too
MAX_SEQ_LEN = 32
FUSION_TASKS = [name for name, (kind, *_) in TASKS.items() if kind == "fusion"]


@dataclass(frozen=True)
class Artifacts:
    fp32: Path
    fp16: Path

    def __getitem__(self, precision: str) -> Path:
        return getattr(self, precision)


def _batches() -> dict[str, list[TextInput]]:
    long = " ".join(["the movie was great and the plot is not boring"] * 6)  # truncated to MAX_SEQ_LEN
    return {
        "single": [TextInput(SENTENCES[0])],
        "padded": [TextInput(s) for s in SENTENCES],
        "pairs": [TextInput(a, b) for a, b in PAIRS],
        "truncated": [TextInput(long), TextInput(SENTENCES[3])],
    }


def _run_all(runner: OnnxRunner, task: str, inputs: list[TextInput]):
    enc = runner.encoder.encode(inputs)
    return runner.run(task, enc, return_fusion_activations=task in FUSION_TASKS)


def _assert_same(got, want, tol: float, what: str, acts_tol: float | None = None) -> None:
    assert got.logits.dtype == np.float32 and got.logits.shape == want.logits.shape, what
    diff = float(np.abs(got.logits - want.logits).max())
    assert diff <= tol, f"{what}: logits differ by {diff:.2e} (tolerance {tol:g})"
    if want.fusion_activations is not None and acts_tol is not None:
        assert got.fusion_activations.shape == want.fusion_activations.shape, what
        diff = float(np.abs(got.fusion_activations - want.fusion_activations).max())
        assert diff <= acts_tol, f"{what}: fusion activations differ by {diff:.2e} (tolerance {acts_tol:g})"
