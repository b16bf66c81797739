"""``fusionserve evaluate``: accuracy of a classification task on labelled JSONL lines (the other heads' metrics:
``evaluate_heads.py``).

Input lines are ``{"text": ..., "text_pair": ..., "label": ...}``; a line without a usable text or with a label the
task does not have is reported with the reason and left out of the accuracy, and the rest go on.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model import heads
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runner import ActivationRunner

from .inputs import LabelledInput, batched


@dataclass(frozen=True)
class Evaluation:
    task: str
    examples: int
    correct: int
    per_label: dict[str, tuple[int, int]]  # label -> (examples, correct)
    bad: list[tuple[int, str]]  # (line, why) of the lines left out

    @property
    def accuracy(self) -> float:
        """Percent correct."""
        return 100.0 * self.correct / self.examples

    @property
    def ci95(self) -> tuple[float, float]:
        """Wilson 95% interval of the accuracy, in percent."""
        n, p, z = self.examples, self.correct / self.examples, 1.96
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)

    def as_dict(self) -> dict[str, Any]:
        low, high = self.ci95
        return {
            "task": self.task,
            "examples": self.examples,
            "correct": self.correct,
            "accuracy": round(self.accuracy, 2),
            "ci95": [round(low, 2), round(high, 2)],
            "per_label": {k: {"examples": n, "correct": c} for k, (n, c) in self.per_label.items()},
            "bad_lines": len(self.bad),
        }


def evaluate(
    runner: ActivationRunner,
    task: str,
    inputs: Iterator[tuple[int, LabelledInput | InputError]],
    batch_size: int = 32,
    progress: bool = False,
) -> Evaluation:
    """Accuracy of ``task`` over labelled inputs. Raises FusionServeError for an unknown task, InputError when no
    line is usable."""
    from tqdm import tqdm

    entry = runner.task(task)
    if heads.head(entry) != heads.CLASSIFICATION:
        raise InputError(
            f"task '{task}' is {heads.head(entry)}: its metric is not accuracy over labels; `fusionserve evaluate` "
            "reports it (evaluate_heads.py)"
        )
    labels = entry.labels
    index = {label: i for i, label in enumerate(labels)}
    per_label = {label: [0, 0] for label in labels}
    bad: list[tuple[int, str]] = []
    bar = tqdm(desc=f"evaluate {task}", unit="text", disable=not progress, file=sys.stderr)
    for batch in batched(inputs, batch_size):
        good: list[tuple[TextInput, int]] = []
        for no, x in batch:
            if isinstance(x, InputError):
                bad.append((no, str(x)))
            elif x.label is None:
                bad.append((no, "missing field 'label'"))
            elif x.label not in index:
                bad.append((no, f"label {x.label!r} is not one of task '{task}''s labels: {', '.join(labels)}"))
            else:
                good.append((x.input, index[x.label]))
        if good:
            logits = runner.run(task, runner.encoder.encode([x for x, _ in good])).logits
            for (_, want), got in zip(good, np.argmax(logits, axis=-1), strict=True):
                per_label[labels[want]][0] += 1
                per_label[labels[want]][1] += int(got == want)
        bar.update(len(batch))
    bar.close()
    examples = sum(n for n, _ in per_label.values())
    if not examples:
        raise InputError(f"no usable labelled line to evaluate task '{task}' on ({len(bad)} bad line(s))")
    correct = sum(c for _, c in per_label.values())
    return Evaluation(task, examples, correct, {k: (n, c) for k, (n, c) in per_label.items()}, bad)
