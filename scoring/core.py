"""Scoring rows with a runner: the core that the local run (``score.py``) and the Ray Data actors (``score_ray.py``)
both call (the columns a run adds are ``columns.py``'s). No file handling and no Ray here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model import heads
from fusionserve.serving.model.activations import token_means
from fusionserve.serving.model.artifact import TaskEntry
from fusionserve.serving.model.heads import HeadOptions
from fusionserve.serving.model.predictions import Input
from fusionserve.serving.model.rows import compute
from fusionserve.serving.model.runtime import OnnxRunner

from .readers import InputFields, Record


@dataclass(frozen=True)
class Scored:
    prediction: Any  # the task's prediction, as POST /v1/classify gives it (``heads.answer``)
    activations: tuple[float, ...] | None  # per task adapter: mean fusion weight over layers and real tokens
    truncated: bool

    @property
    def label(self) -> str | None:
        return self.prediction.get("label") if isinstance(self.prediction, dict) else None

    @property
    def score(self) -> float | None:
        """A classification task's label probability (logit with raw scores), a regression task's value."""
        return self.prediction.get("score") if isinstance(self.prediction, dict) else None


def mean_activations(acts: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(batch, task adapters): each adapter's fusion weight averaged over the row's real tokens, then over layers
    (each layer's weights sum to 1, so a row's values do too)."""
    per_layer = token_means(acts, mask, np.float64)  # (batch, layers, adapters)
    return np.round(per_layer.mean(axis=1), 6)


def score_inputs(
    runner: OnnxRunner,
    task: str,
    inputs: Sequence[Input],
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
    truncation: str = "right",
    raw: bool = False,
    options: HeadOptions | None = None,
) -> list[Scored | InputError]:
    """Score ``inputs`` for one task; see ``score_tasks``."""
    scored = score_tasks(runner, (task,), inputs, batch_size, activations, on_rows, truncation, raw, options)
    return [r if isinstance(r, InputError) else r[0] for r in scored]


def score_tasks(
    runner: OnnxRunner,
    tasks: Sequence[str],
    inputs: Sequence[Input],
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
    truncation: str = "right",
    raw: bool = False,
    options: HeadOptions | None = None,
) -> list[tuple[Scored, ...] | InputError]:
    """Score ``inputs`` (each the shape every task's head takes) for each of ``tasks`` in batches of similar token
    length, tokenized once per kind of rows (cut from ``truncation``'s side when too long); per input, one Scored per
    task, in input order, with probabilities (or the logits, unrounded, when ``raw``), or the InputError of an input
    a head cannot make rows of (a question too long for a window). Raises what the runner raises (unknown task, no
    fusion for activations, runtime failure)."""
    entries = [runner.artifact.task(t) for t in tasks]
    if not inputs:  # a chunk whose rows were all bad
        return []
    options = options or HeadOptions()
    computed = compute(runner, entries, inputs, options, batch_size, truncation, activations, on_rows)
    out: list[list[Scored] | InputError] = [[] for _ in inputs]
    for entry, per_input in zip(entries, computed, strict=True):
        for i, (inp, c) in enumerate(zip(inputs, per_input, strict=True)):
            done = out[i]
            if c.unit.error is not None or isinstance(done, InputError):
                out[i] = done if isinstance(done, InputError) else c.unit.error  # type: ignore[assignment]
                continue
            acts = None if c.activations is None else tuple(round(float(v), 6) for v in c.activations.mean(axis=0))
            done.append(Scored(heads.answer(entry, inp, c.unit, c.outputs, options, raw), acts, c.unit.truncated))
    return [s if isinstance(s, InputError) else tuple(s) for s in out]


def score_records(
    runner: OnnxRunner,
    tasks: Sequence[str],
    records: Sequence[Record | InputError],
    fields: InputFields,
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
    truncation: str = "right",
    raw: bool = False,
    options: HeadOptions | None = None,
) -> list[tuple[Scored, ...] | InputError]:
    """One result per record, in order: one Scored per task, or the InputError of a row that lacks what a task's head
    reads (``InputFields.read``: its text; a multiple-choice task's choices; a question-answering task's question and
    context) or that a head cannot make rows of. Tasks whose heads take the same shape of input are scored together."""
    entries = [runner.artifact.task(t) for t in tasks]
    shapes = [heads.TAKES[heads.head(e)] for e in entries]
    per_row = [_inputs(r, fields, entries) for r in records]
    good = [k for k, x in enumerate(per_row) if not isinstance(x, InputError)]
    results: dict[int, list[Scored | None] | InputError] = {k: [None] * len(tasks) for k in good}
    for n, shape in enumerate(dict.fromkeys(shapes)):
        which = [t for t, s in enumerate(shapes) if s is shape]
        scored = score_tasks(runner, [tasks[t] for t in which], [per_row[k][shape] for k in good], batch_size,  # type: ignore[index]
                             activations, on_rows if n == 0 else None, truncation, raw, options)  # fmt: skip
        for k, row in zip(good, scored, strict=True):
            slot = results[k]
            if isinstance(row, InputError) or isinstance(slot, InputError):
                results[k] = slot if isinstance(slot, InputError) else row  # type: ignore[assignment]
                continue
            for j, t in enumerate(which):
                slot[t] = row[j]
    out: list[tuple[Scored, ...] | InputError] = []
    for k, x in enumerate(per_row):
        r = x if isinstance(x, InputError) else results[k]
        out.append(r if isinstance(r, InputError) else tuple(r))  # type: ignore[arg-type]
    return out


def _inputs(record: Record | InputError, fields: InputFields, entries: Sequence[TaskEntry]) -> dict[type, Input] | InputError:
    """The input each task's head reads from ``record``, by shape; or the InputError of the first it cannot."""
    if isinstance(record, InputError):
        return record
    out: dict[type, Input] = {}
    try:
        for e in entries:
            shape = heads.TAKES[heads.head(e)]
            if shape not in out:
                out[shape] = fields.read(record, shape)
            heads.check_input(e, out[shape])
    except InputError as exc:
        return exc
    return out
