"""Inputs run as rows without the server's scheduler: what ``predict``, ``score`` and ``evaluate`` run, with any
runner. Each input becomes its head's rows (``heads.units``: one, or one per choice, or one per window), the rows are
sorted by length into batches (so a batch pads little), and each input gets its rows' outputs back in order; tasks
whose heads make the same rows of the same inputs share them (tokenized once). No torch here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .activations import token_means
from .artifact import TaskEntry
from .heads import HeadOptions, Unit, head, row_key, units
from .predictions import Input
from .runner import ActivationRunner


@dataclass(frozen=True)
class Computed:
    """One input for one task: its rows and their outputs, ready for ``heads.answer``."""

    unit: Unit
    outputs: list[np.ndarray]  # per row: (labels,), or (tokens, labels) for a token-level head
    activations: np.ndarray | None  # (layers, task adapters): the mean of its rows' token means; fusion, when asked


def compute(
    runner: ActivationRunner,
    entries: Sequence[TaskEntry],
    inputs: Sequence[Input],
    options: HeadOptions,
    batch_size: int,
    truncation: str = "right",
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
) -> list[list[Computed]]:
    """Per task of ``entries``, per input, what the model computed; the inputs must be the shape every task's head
    takes (``heads.check_input``). ``activations``: fusion tasks' activations too. ``on_rows``: called with the inputs
    each batch finished (once per batch of the first task's rows). Raises what the tokenizer and the runner raise."""
    made: dict[str, list[Unit]] = {}
    out: list[list[Computed]] = []
    for k, entry in enumerate(entries):
        kind = head(entry)
        key = row_key(kind)
        if key not in made:
            made[key] = units(runner.encoder, kind, inputs, truncation, options)
        fusion = activations and entry.kind == "fusion"
        out.append(_run(runner, entry, made[key], batch_size, fusion, on_rows if k == 0 else None))
    return out


def _run(
    runner: ActivationRunner,
    entry: TaskEntry,
    per_input: list[Unit],
    batch_size: int,
    activations: bool,
    on_rows: Callable[[int], object] | None,
) -> list[Computed]:
    rows = [(i, t) for i, u in enumerate(per_input) for t in u.rows]
    order = sorted(range(len(rows)), key=lambda r: rows[r][1].length)
    outputs: list[np.ndarray | None] = [None] * len(rows)
    acts: list[np.ndarray | None] = [None] * len(rows)
    left = [len(u.rows) for u in per_input]  # rows of each input not yet run
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = runner.encoder.pad([rows[r][1] for r in idx])
        res = runner.run(entry.name, enc, return_fusion_activations=activations)
        lengths = enc.attention_mask.sum(axis=1)
        for j, r in enumerate(idx):
            outputs[r] = res.logits[j, : lengths[j]] if res.logits.ndim == 3 else res.logits[j]
            left[rows[r][0]] -= 1
        if res.fusion_activations is not None:
            means = token_means(res.fusion_activations, enc.attention_mask, np.float64)  # (batch, layers, task adapters)
            for j, r in enumerate(idx):
                acts[r] = means[j]
        if on_rows is not None:
            on_rows(len({rows[r][0] for r in idx if left[rows[r][0]] == 0}))  # the inputs this batch finished
    done, at = [], 0
    for u in per_input:
        mine = range(at, at + len(u.rows))
        act = None if acts[at] is None else np.mean([acts[r] for r in mine], axis=0)
        done.append(Computed(u, [outputs[r] for r in mine], act))  # type: ignore[misc]
        at += len(u.rows)
    return done
