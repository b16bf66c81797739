"""``fusionserve evaluate`` for heads beyond classification, each with its usual metric (``metrics.py``):

- regression: Pearson and Spearman correlation; lines ``{"text", "text_pair"?, "label": number}``
- multiple choice: accuracy; lines ``{"text", "choices", "label": index}`` (or the right choice's text)
- tagging: entity-level precision, recall and F1 the seqeval way; lines ``{"tokens": [words], "tags": [tags]}`` (CoNLL
  style; tags as label names or ids), run as the words joined by single spaces, each word predicted by its first word
  piece (as Hugging Face's token-classification examples score a model)
- question answering: SQuAD exact match and F1; lines ``{"question", "context", "answers": [texts]}`` (or SQuAD's
  ``{"text": [...], "answer_start": [...]}``; an empty list: the question has no answer in the context)

A line without what its head reads, or with a gold value the task cannot have, is reported with the reason and left out,
and the rest go on."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model import heads
from fusionserve.serving.model.artifact import TaskEntry
from fusionserve.serving.model.heads import MULTIPLE_CHOICE, QUESTION_ANSWERING, REGRESSION, TAGGING, HeadOptions
from fusionserve.serving.model.predictions import ChoiceInput, Input, TextInput, read_input
from fusionserve.serving.model.rows import Computed, compute
from fusionserve.serving.model.runner import ActivationRunner

from . import metrics
from .inputs import batched, json_lines


@dataclass(frozen=True)
class HeadEvaluation:
    task: str
    head: str
    examples: int
    metrics: dict[str, float]  # the head's metrics (percent for accuracy, F1 and exact match; correlations as they are)
    bad: list[tuple[int, str]]  # (line, why) of the lines left out

    def as_dict(self) -> dict[str, Any]:
        # a correlation is undefined (NaN) for a constant series: null in JSON
        rounded = {k: None if math.isnan(v) else round(v, 4) for k, v in self.metrics.items()}
        return {"task": self.task, "head": self.head, "examples": self.examples, **rounded, "bad_lines": len(self.bad)}

    def render(self) -> str:
        shown = ", ".join(f"{k} {v:.4f}" if k in ("pearson", "spearman") else f"{k} {v:.2f}%" for k, v in self.metrics.items())
        return f"{self.task} ({self.head}): {shown} over {self.examples} examples"


def _gold(kind: str, entry: TaskEntry, obj: Any) -> tuple[Input, Any]:
    """A labelled line as (the input its head reads, the gold answer); raises InputError naming what is wrong."""
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}")
    if kind == TAGGING:
        return _tagged(entry, obj)
    if kind == QUESTION_ANSWERING:
        answers = obj.get("answers")
        texts = answers.get("text") if isinstance(answers, dict) else answers
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InputError("'answers' must be a list of answer texts (or SQuAD's {\"text\": [...]}); [] for no answer")
        return read_input({k: v for k, v in obj.items() if k != "answers"}), texts
    if "label" not in obj:
        raise InputError("missing field 'label'")
    label = obj["label"]
    inp = read_input({k: v for k, v in obj.items() if k != "label"})
    if kind == REGRESSION:
        if isinstance(label, bool) or not isinstance(label, (int, float)) or not math.isfinite(label):
            raise InputError(f"'label' must be a number (the gold value), got {label!r:.40}")
        return inp, float(label)
    if not isinstance(inp, ChoiceInput):
        return inp, None  # heads.check_input names the shape
    if isinstance(label, str) and label in inp.choices:
        return inp, inp.choices.index(label)
    if isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(inp.choices):
        return inp, label
    raise InputError(f"'label' must be the right choice's index 0..{len(inp.choices) - 1} or its text, got {label!r:.40}")


def _tagged(entry: TaskEntry, obj: dict[str, Any]) -> tuple[Input, list[str]]:
    words, tags = obj.get("tokens"), obj.get("tags")
    if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() and " " not in w for w in words):
        raise InputError("'tokens' must be a non-empty list of words (strings without spaces)")
    if not isinstance(tags, list) or len(tags) != len(words):
        raise InputError(f"'tags' must be a list of one tag per word ({len(words)}), got {tags!r:.60}")
    names = []
    for t in tags:
        if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(entry.labels):
            names.append(entry.labels[t])
        elif isinstance(t, str) and t in entry.labels:
            names.append(t)
        else:
            raise InputError(
                f"tag {t!r:.40} is not one of task '{entry.name}''s labels (or their ids): {', '.join(entry.labels)}"
            )
    return TextInput(" ".join(words), id=obj.get("id")), names


def word_tags(entry: TaskEntry, inp: TextInput, c: Computed) -> list[str]:
    """Per word of ``inp.text`` (split at single spaces), the label of its first word piece; "O" for a word past the
    token limit."""
    enc, shift = c.unit.detail[0], c.unit.detail[1]
    logits = c.outputs[0]  # (tokens, labels)
    first: dict[int, int] = {}  # character where a word piece starts -> the piece
    for k, ((start, end), special) in enumerate(zip(enc.offsets, enc.special_tokens_mask, strict=True)):
        if not special and end > start:
            first.setdefault(start + shift, k)
    out, at = [], 0
    for word in inp.text.split(" "):
        k = first.get(at)
        out.append(entry.labels[int(np.argmax(logits[k]))] if k is not None and k < len(logits) else "O")
        at += len(word) + 1
    return out


def _prediction(kind: str, entry: TaskEntry, inp: Input, c: Computed) -> Any:
    if kind == REGRESSION:
        return float(c.outputs[0][0])
    if kind == MULTIPLE_CHOICE:
        return int(np.argmax([float(o[0]) for o in c.outputs]))
    if kind == TAGGING:
        return word_tags(entry, inp, c)  # type: ignore[arg-type]
    best = heads.answer(entry, inp, c.unit, c.outputs, HeadOptions())
    best = best[0] if isinstance(best, list) else best
    return best.get("answer", "") if best else ""


def _metrics(kind: str, gold: list[Any], pred: list[Any]) -> dict[str, float]:
    """The head's metrics: correlations as they are, the others in percent (``metrics`` gives fractions)."""
    if kind == REGRESSION:
        return {"pearson": metrics.pearson(gold, pred), "spearman": metrics.spearman(gold, pred)}
    if kind == MULTIPLE_CHOICE:
        return {"accuracy": 100.0 * metrics.accuracy(gold, pred)}
    if kind == TAGGING:
        found = metrics.entity_f1(gold, pred)
        return {k: 100.0 * found[k] for k in ("precision", "recall", "f1")}
    return {k: 100.0 * v for k, v in metrics.squad(gold, pred).items()}


def evaluate_head(
    runner: ActivationRunner,
    task: str,
    path: Path,
    batch_size: int = 32,
    progress: bool = False,
) -> HeadEvaluation:
    """The usual metric of ``task`` (not a classification task) over the labelled JSON lines of ``path``. Raises
    InputError when the file is unreadable or no line is usable, FusionServeError for an unknown task."""
    from tqdm import tqdm

    entry = runner.task(task)
    kind = heads.head(entry)
    gold: list[Any] = []
    pred: list[Any] = []
    bad: list[tuple[int, str]] = []
    bar = tqdm(desc=f"evaluate {task}", unit="example", disable=not progress, file=sys.stderr)
    for batch in batched(json_lines(path), batch_size):
        good: list[tuple[int, Input, Any]] = []
        for no, obj in batch:
            try:
                if isinstance(obj, InputError):
                    raise obj
                inp, want = _gold(kind, entry, obj)
                heads.check_input(entry, inp)
                good.append((no, inp, want))
            except InputError as exc:
                bad.append((no, str(exc)))
        if good:
            inputs = [x for _, x, _ in good]
            for (no, inp, want), c in zip(good, compute(runner, [entry], inputs, HeadOptions(), batch_size)[0], strict=True):
                if c.unit.error is not None:  # a question too long for a window
                    bad.append((no, str(c.unit.error)))
                    continue
                gold.append(want)
                pred.append(_prediction(kind, entry, inp, c))
        bar.update(len(batch))
    bar.close()
    if not gold:
        raise InputError(f"no usable labelled line to evaluate task '{task}' on ({len(bad)} bad line(s))")
    return HeadEvaluation(task, kind, len(gold), _metrics(kind, gold, pred), bad)
