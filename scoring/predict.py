"""``fusionserve predict``: classify inputs with any runner and write one JSON line per input, in order."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model.predictions import TextInput, label_scores
from fusionserve.serving.model.runner import Runner

from .inputs import batched

# predict reads this many batches of inputs at a time and runs them in batches of similar token length, as `score`
# does: less padding, and the batches the int8 benchmarks measure (docs/guides/int8.md, "int8 as a user meets it")
WINDOW_BATCHES = 32


def format_predictions(
    labels: Sequence[str], logits: np.ndarray, truncated: Sequence[bool], inputs: Sequence[TextInput]
) -> list[dict[str, Any]]:
    """One JSON-ready dict per row: label, scores (label -> probability), logits in label-id order."""
    if len(logits) != len(inputs):
        raise RuntimeError(f"runner returned {len(logits)} rows for {len(inputs)} inputs")
    out = []
    for row, (label, _, scores), cut, inp in zip(logits, label_scores(labels, logits), truncated, inputs, strict=True):
        item: dict[str, Any] = {} if inp.id is None else {"id": inp.id}
        item["label"] = label
        item["scores"] = scores
        item["logits"] = [round(float(v), 6) for v in row]
        if cut:
            item["truncated"] = True
        out.append(item)
    return out


def predict_logits(
    runner: Runner, task: str, inputs: Sequence[TextInput], batch_size: int, on_rows: Callable[[int], object] | None = None
) -> tuple[np.ndarray, list[bool]]:
    """(rows, labels) logits and truncation flags of ``inputs`` in input order, run in batches of ``batch_size`` texts of
    similar token length (tokenized once, each batch padded to its own longest) where the runner takes encoded batches
    (``ActivationRunner``), else in input order; ``on_rows`` is told each batch's size. Raises what the runner raises."""
    encoder, run = getattr(runner, "encoder", None), getattr(runner, "run", None)
    logits = np.zeros((len(inputs), len(runner.labels[task])), dtype=np.float32)
    if encoder is None or run is None:
        truncated: list[bool] = []
        for i in range(0, len(inputs), batch_size):
            logits[i : i + batch_size], cut = runner.logits(task, inputs[i : i + batch_size])
            truncated += cut
            if on_rows is not None:
                on_rows(len(cut))
        return logits, truncated
    encoded = encoder.encode(inputs)
    order = np.argsort(encoded.attention_mask.sum(axis=1), kind="stable")
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        logits[idx] = run(task, encoded.rows(idx)).logits  # (batch, labels)
        if on_rows is not None:
            on_rows(len(idx))
    return logits, list(encoded.truncated)


def predict(
    runner: Runner,
    task: str,
    inputs: Iterator[tuple[int, TextInput | InputError]],
    out: TextIO,
    batch_size: int = 32,
    progress: bool = False,
) -> tuple[int, int]:
    """Classify ``inputs`` and write one JSON line per input, in order; a bad input gets an ``error`` line and
    the rest go on. Returns (predicted, failed). Raises InputError for an unknown task."""
    from tqdm import tqdm

    labels = runner.labels
    if task not in labels:
        raise InputError(f"unknown task '{task}'; known tasks: {', '.join(labels)}")
    ok = failed = 0
    bar = tqdm(desc=f"predict {task}", unit="text", disable=not progress, file=sys.stderr)
    for batch in batched(inputs, batch_size * WINDOW_BATCHES):
        good = [(no, x) for no, x in batch if isinstance(x, TextInput)]
        rows: dict[int, dict[str, Any]] = {}
        if good:
            logits, truncated = predict_logits(runner, task, [x for _, x in good], batch_size, bar.update)
            for (no, _), row in zip(good, format_predictions(labels[task], logits, truncated, [x for _, x in good]), strict=True):
                rows[no] = row
        for no, x in batch:
            if isinstance(x, InputError):
                rows[no] = {"line": no, "error": str(x)}
                bar.write(f"line {no}: {x}", file=sys.stderr)
                failed += 1
            else:
                ok += 1
            out.write(json.dumps(rows[no], ensure_ascii=False) + "\n")
        bar.update(len(batch) - len(good))
    bar.close()
    return ok, failed
