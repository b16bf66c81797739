"""``fusionserve predict``: run inputs through any runner and write one JSON line per input, in order, shaped by the
task's head as POST /v1/classify shapes its predictions."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model import heads
from fusionserve.serving.model.heads import CLASSIFICATION, MULTIPLE_CHOICE, HeadOptions
from fusionserve.serving.model.predictions import Input, TextInput, label_logits, label_scores
from fusionserve.serving.model.rows import Computed, compute
from fusionserve.serving.model.runner import ActivationRunner, Runner

from .inputs import batched

# predict reads this many batches of inputs at a time and runs them in batches of similar token length, as `score`
# does: less padding, and the batches the int8 benchmarks measure (docs/guides/int8.md, "int8 as a user meets it")
WINDOW_BATCHES = 32


def format_predictions(
    labels: Sequence[str], logits: np.ndarray, truncated: Sequence[bool], inputs: Sequence[TextInput], raw: bool = False
) -> list[dict[str, Any]]:
    """A classification task's lines: label, scores (label -> probability; with ``raw`` the logit, unrounded, as the
    API's raw_scores), logits in label-id order."""
    if len(logits) != len(inputs):
        raise RuntimeError(f"runner returned {len(logits)} rows for {len(inputs)} inputs")
    out, named = [], (label_logits if raw else label_scores)(labels, logits)
    for row, (label, _, scores), cut, inp in zip(logits, named, truncated, inputs, strict=True):
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
    """A classification task's (rows, labels) logits and truncation flags of ``inputs`` in input order, run as
    ``predict`` runs them: in batches of ``batch_size`` texts of similar token length (``rows.compute``) where the runner
    takes encoded batches (``ActivationRunner``), else in input order; ``on_rows`` is told the inputs each batch
    finished. Raises what the runner raises."""
    if getattr(runner, "encoder", None) is None or getattr(runner, "run", None) is None:
        logits = np.zeros((len(inputs), len(runner.labels[task])), dtype=np.float32)
        truncated: list[bool] = []
        for i in range(0, len(inputs), batch_size):
            logits[i : i + batch_size], cut = runner.logits(task, inputs[i : i + batch_size])
            truncated += cut
            if on_rows is not None:
                on_rows(len(cut))
        return logits, truncated
    active: ActivationRunner = runner  # type: ignore[assignment]
    done = compute(active, [active.task(task)], inputs, HeadOptions(), batch_size, on_rows=on_rows)[0]
    return np.stack([c.outputs[0] for c in done]), [c.unit.truncated for c in done]


def _line(entry: Any, inp: Input, c: Computed, options: HeadOptions, raw: bool) -> dict[str, Any]:
    """One input's line: a classification task's as ``format_predictions`` writes it; another head's prediction as the
    API gives it (question answering with top_k > 1: under "answers"), a multiple-choice task's with its logits."""
    kind = heads.head(entry)
    if kind == CLASSIFICATION:
        return format_predictions(entry.labels, np.stack(c.outputs), [c.unit.truncated], [inp], raw)[0]  # type: ignore[list-item]
    pred = heads.answer(entry, inp, c.unit, c.outputs, options, raw)
    item: dict[str, Any] = {} if inp.id is None else {"id": inp.id}
    item.update({"answers": pred} if isinstance(pred, list) else {k: v for k, v in pred.items() if k != "truncated"})
    if kind == MULTIPLE_CHOICE:
        item["logits"] = [round(float(o[0]), 6) for o in c.outputs]
    if c.unit.truncated:
        item["truncated"] = True
    return item


def predict(
    runner: ActivationRunner,
    task: str,
    inputs: Iterator[tuple[int, Input | InputError]],
    out: TextIO,
    batch_size: int = 32,
    progress: bool = False,
    options: HeadOptions | None = None,
    raw: bool = False,
) -> tuple[int, int]:
    """Run ``inputs`` for ``task`` and write one JSON line per input, in order; an input that is bad, or not the shape
    the task's head takes, gets an ``error`` line and the rest go on. Returns (predicted, failed). Raises InputError
    for an unknown task or an option the task's head does not read."""
    from tqdm import tqdm

    if task not in runner.labels:
        raise InputError(f"unknown task '{task}'; known tasks: {', '.join(runner.labels)}")
    entry = runner.task(task)
    options = options or HeadOptions()
    options.check([entry], raw, runner.encoder.max_length)
    ok = failed = 0
    bar = tqdm(desc=f"predict {task}", unit="input", disable=not progress, file=sys.stderr)
    for batch in batched(inputs, batch_size * WINDOW_BATCHES):
        rows: dict[int, dict[str, Any]] = {}
        errors: dict[int, InputError] = {}
        good: list[tuple[int, Input]] = []
        for no, x in batch:
            try:
                if isinstance(x, InputError):
                    raise x
                heads.check_input(entry, x)
                good.append((no, x))
            except InputError as exc:
                errors[no] = exc
        if good:
            computed = compute(runner, [entry], [x for _, x in good], options, batch_size, on_rows=bar.update)[0]
            for (no, x), c in zip(good, computed, strict=True):
                if c.unit.error is not None:  # a question too long for a window
                    errors[no] = c.unit.error
                else:
                    rows[no] = _line(entry, x, c, options, raw)
        for no, exc in errors.items():
            rows[no] = {"line": no, "error": str(exc)}
            bar.write(f"line {no}: {exc}", file=sys.stderr)
        ok, failed = ok + len(batch) - len(errors), failed + len(errors)
        for no, _ in batch:
            out.write(json.dumps(rows[no], ensure_ascii=False) + "\n")
        bar.update(len(batch) - len(good))
    bar.close()
    return ok, failed
