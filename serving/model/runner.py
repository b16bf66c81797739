"""What a runner is: the one output type and the protocols every runner satisfies — the ONNX Runtime runner of
an artifact (``serving.runtime.OnnxRunner``) and the PyTorch runner of a spec (``export.predict.TorchRunner``).
The CLI, scoring, calibration and evaluation are written against these, never against one runner. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .artifact import TaskEntry
from .predictions import TextInput
from .tokenize import Encoded, Encoder


@dataclass(frozen=True)
class Output:
    logits: np.ndarray  # (batch, num_labels) float32
    fusion_activations: np.ndarray | None  # (batch, layers, seq, n_task_adapters), when asked
    encoded: Encoded


class Runner(Protocol):
    """Anything that turns texts into logits for a task (PyTorch model, ONNX Runtime session)."""

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        """Task name -> labels in label-id order."""
        ...

    def logits(self, task: str, inputs: Sequence[TextInput]) -> tuple[np.ndarray, list[bool]]:
        """(batch, num_labels) float logits and, per input, whether it was truncated to the length limit."""
        ...


class ActivationRunner(Runner, Protocol):
    """A runner that also describes its tasks and returns fusion activations (``OnnxRunner``, ``TorchRunner``)."""

    encoder: Encoder

    def task(self, name: str) -> TaskEntry: ...

    def run(self, task: str, encoded: Encoded, return_fusion_activations: bool = False) -> Output: ...
