"""What the batching scheduler reports: a request's result, and one model call's figures for the metrics (a batch may
mix tasks). Plain data, no threads: ``batching.py`` makes them, the deployment and the metrics read them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..model.heads import Unit


@dataclass(frozen=True)
class TaskShare:
    """One task's rows in a batch."""

    inputs: int
    truncated: int
    activation_sums: np.ndarray | None  # (layers, task adapters): its rows' per-input token means, summed
    adapters: tuple[str, ...] = ()  # the task's adapters in the revision that answered: the sums' second axis


@dataclass(frozen=True)
class BatchStats:
    """What one model call did, for the metrics."""

    inputs: int
    requests: int  # requests with a row in this batch
    tokens: int  # batch x padded length (the bucket's, when the runner buckets): what the model computed over
    model_ms: float
    truncated: int
    tasks: dict[str, TaskShare]  # the batch's mix

    @property
    def task(self) -> str:
        """The batch's task when it holds one (the mixed ones: "mixed")."""
        return next(iter(self.tasks)) if len(self.tasks) == 1 else "mixed"


@dataclass(frozen=True)
class TaskResult:
    outputs: list[list[np.ndarray]]  # per input, its rows' logits ((labels,) per row, (tokens, labels) token-level)
    activations: np.ndarray | None  # (inputs, layers, task adapters): mean over each input's real tokens; fusion only
    truncated: list[bool]  # per input
    units: list[Unit]  # per input: its rows, and what its head's answer reads besides their logits

    @property
    def logits(self) -> np.ndarray:
        """(inputs, num_labels), label-id order: for heads that run one sequence-level row per input."""
        if any(len(rows) != 1 or rows[0].ndim != 1 for rows in self.outputs):
            raise ValueError("logits: an input of this task made several rows, or token-level ones; read outputs")
        return np.stack([rows[0] for rows in self.outputs])


@dataclass(frozen=True)
class BatchSpan:
    """One model call a request's rows went through, as a trace shows it (``time.perf_counter()`` seconds): taken
    from the queue, the model run (padding + ONNX Runtime), the results handed back."""

    taken_s: float
    model_start_s: float
    model_end_s: float
    inputs: int
    tokens: int
    tasks: tuple[str, ...]
    revision: int | None


@dataclass(frozen=True)
class JobResult:
    tasks: dict[str, TaskResult]  # in the order asked for
    truncated: list[bool]  # per input
    queue_ms: float  # arrival -> the first batch that took one of its rows
    batches: int  # how many model calls its rows went through
    # where its time went (``time.perf_counter()`` seconds), for traces: submitted, tokenized (rows queued), and each
    # batch it ran in
    submitted_s: float = 0.0
    tokenized_s: float = 0.0
    spans: tuple[BatchSpan, ...] = ()

    @property
    def logits(self) -> np.ndarray:
        """The first (for a one-task request: the) task's logits."""
        return next(iter(self.tasks.values())).logits

    @property
    def activations(self) -> np.ndarray | None:
        return next(iter(self.tasks.values())).activations


def shares(
    tasks: list[str], acts: list[np.ndarray | None], truncated: list[bool], adapters: Mapping[str, tuple[str, ...]]
) -> dict[str, TaskShare]:
    """Per task of a batch's rows (in order: their tasks, fusion activation means, truncation flags): its share, with
    its adapters (``adapters``: each task's, in the revision the batch ran on)."""
    out: dict[str, list[Any]] = {}
    for task, a, cut in zip(tasks, acts, truncated, strict=True):
        slot = out.setdefault(task, [0, 0, None])
        slot[0] += 1
        slot[1] += int(cut)
        if a is not None:
            slot[2] = a.copy() if slot[2] is None else slot[2] + a
    return {t: TaskShare(n, cut, sums, adapters.get(t, ())) for t, (n, cut, sums) in out.items()}
