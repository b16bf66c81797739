"""Scoring rows with a runner: the core that the local run (``score.py``) and the Ray Data actors
(``score_ray.py``) both call, and the columns a run adds to each row. No file handling and no Ray here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from fusionserve.errors import InputError
from fusionserve.serving.model.activations import token_means
from fusionserve.serving.model.artifact import TaskEntry
from fusionserve.serving.model.predictions import TextInput, label_logits, label_scores
from fusionserve.serving.model.runtime import OnnxRunner

from .config import ScoreConfig
from .readers import Record, to_input


@dataclass(frozen=True)
class Scored:
    label: str
    score: float  # probability of ``label`` (its logit with raw scores)
    scores: tuple[float, ...]  # every label's probability (logit), label-id order
    activations: tuple[float, ...] | None  # per task adapter: mean fusion weight over layers and real tokens
    truncated: bool


def mean_activations(acts: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(batch, task adapters): each adapter's fusion weight averaged over the row's real tokens, then over layers
    (each layer's weights sum to 1, so a row's values do too)."""
    per_layer = token_means(acts, mask, np.float64)  # (batch, layers, adapters)
    return np.round(per_layer.mean(axis=1), 6)


def score_inputs(
    runner: OnnxRunner,
    task: str,
    inputs: Sequence[TextInput],
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
    truncation: str = "right",
    raw: bool = False,
) -> list[Scored]:
    """Score ``inputs`` for one task; see ``score_tasks``."""
    return [r[0] for r in score_tasks(runner, (task,), inputs, batch_size, activations, on_rows, truncation, raw)]


def score_tasks(
    runner: OnnxRunner,
    tasks: Sequence[str],
    inputs: Sequence[TextInput],
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
    truncation: str = "right",
    raw: bool = False,
) -> list[tuple[Scored, ...]]:
    """Score ``inputs`` for each of ``tasks`` in batches of similar token length, tokenized once (cut from
    ``truncation``'s side when too long); per input, one Scored per task, in input order, with probabilities (or the
    logits, unrounded, when ``raw``). Raises what the runner raises (unknown task, no fusion for activations,
    runtime failure)."""
    labels = [runner.artifact.task(t).labels for t in tasks]
    if not inputs:  # a chunk whose rows were all bad
        return []
    # tokenized once: the lengths to sort by, and every batch a slice of it padded to its own longest
    encoded = runner.encoder.encode(inputs, truncation)
    scoring = label_logits if raw else label_scores
    lengths = encoded.attention_mask.sum(axis=1)
    order = sorted(range(len(inputs)), key=lengths.__getitem__)
    out: list[list[Scored]] = [[] for _ in inputs]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = encoded.rows(idx)
        for task, task_labels in zip(tasks, labels, strict=True):
            res = runner.run(task, enc, return_fusion_activations=activations)
            acts = None
            if res.fusion_activations is not None:
                acts = mean_activations(res.fusion_activations, enc.attention_mask)  # (batch, task adapters)
            for k, (i, (label, score, probs)) in enumerate(zip(idx, scoring(task_labels, res.logits), strict=True)):
                row_acts = None if acts is None else tuple(float(v) for v in acts[k])
                out[i].append(Scored(label, score, tuple(probs.values()), row_acts, enc.truncated[k]))
        if on_rows is not None:
            on_rows(len(idx))
    if any(len(s) != len(tasks) for s in out):
        raise RuntimeError(f"scored {sum(len(s) == len(tasks) for s in out)} of {len(out)} inputs")
    return [tuple(s) for s in out]


def score_records(
    runner: OnnxRunner,
    tasks: Sequence[str],
    records: Sequence[Record | InputError],
    text_field: str,
    pair_field: str | None,
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
    truncation: str = "right",
    raw: bool = False,
) -> list[tuple[Scored, ...] | InputError]:
    """One result per record, in order: one Scored per task, or the InputError of a row that has no usable text."""
    inputs = [r if isinstance(r, InputError) else to_input(r, text_field, pair_field) for r in records]
    texts = [x for x in inputs if isinstance(x, TextInput)]
    scored = iter(score_tasks(runner, tasks, texts, batch_size, activations, on_rows, truncation, raw))
    return [x if isinstance(x, InputError) else next(scored) for x in inputs]


@dataclass(frozen=True)
class Added:
    """Columns a run adds to each row: ``label``, ``score``, then ``score_<label>`` (all scores) and
    ``activation_<adapter>`` (activations), each name behind ``prefix``; with several tasks, each task's columns
    in turn, named ``<task>_label``, ``<task>_score``, ... (behind ``prefix``)."""

    names: tuple[str, ...]
    per_task: tuple[tuple[int, int], ...]  # per task: (score columns, activation columns)

    @classmethod
    def of(cls, cfg: ScoreConfig, entries: Sequence[TaskEntry]) -> Added:
        names: list[str] = []
        per_task = []
        for entry in entries:
            p = cfg.prefix if len(entries) == 1 else f"{cfg.prefix}{entry.name}_"
            scores = [f"{p}score_{lab}" for lab in entry.labels] if cfg.all_scores else []
            acts = [f"{p}activation_{a}" for a in entry.adapters] if cfg.activations else []
            names += [f"{p}label", f"{p}score", *scores, *acts]
            per_task.append((len(scores), len(acts)))
        return cls(tuple(names), tuple(per_task))

    def values(self, results: tuple[Scored, ...]) -> Record:
        vals: list[Any] = []
        for s, (n_scores, n_acts) in zip(results, self.per_task, strict=True):
            vals += [s.label, s.score]
            if n_scores:
                vals += s.scores
            if n_acts and s.activations is not None:
                vals += s.activations
        return dict(zip(self.names, vals, strict=True))

    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, pa.string() if n in self._label_columns() else pa.float64()) for n in self.names])

    def _label_columns(self) -> set[str]:
        out: set[str] = set()
        i = 0
        for n_scores, n_acts in self.per_task:
            out.add(self.names[i])
            i += 2 + n_scores + n_acts
        return out
