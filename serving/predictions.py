"""Inputs and outputs of a classification call, shared by every runner (PyTorch from a spec, ONNX Runtime
from an artifact) and by the CLI. No torch here: numpy only."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from fusionserve.errors import InputError

T = TypeVar("T")


@dataclass(frozen=True)
class TextInput:
    """One text to classify, or a pair (encoded as a pair: [CLS] text [SEP] text_pair [SEP])."""

    text: str
    text_pair: str | None = None
    id: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise InputError(f"'text' must be a non-empty string, got {self.text!r}")
        if self.text_pair is not None and (not isinstance(self.text_pair, str) or not self.text_pair.strip()):
            raise InputError(f"'text_pair' must be a non-empty string or absent, got {self.text_pair!r}")

    @classmethod
    def from_json(cls, obj: Any) -> TextInput:
        """From ``{"text": ..., "text_pair": ..., "id": ...}``; raises InputError naming the problem."""
        if not isinstance(obj, dict):
            raise InputError(f'expected an object like {{"text": "..."}}, got {type(obj).__name__}')
        unknown = set(obj) - {"text", "text_pair", "id"}
        if unknown:
            raise InputError(f"unknown field(s) {sorted(unknown)}; allowed: text, text_pair, id")
        if "text" not in obj:
            raise InputError("missing field 'text'")
        return cls(obj["text"], obj.get("text_pair"), obj.get("id"))


class Runner(Protocol):
    """Anything that turns texts into logits for a task (PyTorch model, ONNX Runtime session)."""

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        """Task name -> labels in label-id order."""
        ...

    def logits(self, task: str, inputs: Sequence[TextInput]) -> tuple[np.ndarray, list[bool]]:
        """(batch, num_labels) float logits and, per input, whether it was truncated to the length limit."""
        ...


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def label_scores(labels: Sequence[str], logits: np.ndarray) -> list[tuple[str, float, dict[str, float]]]:
    """Per row: the winning label, its probability, and every label's probability (rounded to 6 digits)."""
    out = []
    for p in softmax(np.asarray(logits, dtype=np.float64)):
        best = int(np.argmax(p))
        out.append((labels[best], round(float(p[best]), 6), {lab: round(float(v), 6) for lab, v in zip(labels, p, strict=True)}))
    return out


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


@dataclass(frozen=True)
class LabelledInput:
    """An input with its expected label (None in an unlabelled file)."""

    input: TextInput
    label: str | None


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object or the InputError of that line); blank lines are skipped."""
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror}") from None
    with handle:
        for no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield no, json.loads(line)
            except json.JSONDecodeError as exc:
                yield no, InputError(f"not valid JSON: {exc.msg} (column {exc.colno})")


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last may be shorter)."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def read_jsonl(path: Path) -> Iterator[tuple[int, TextInput | InputError]]:
    """(line number, input or the error that line has); blank lines are skipped. Raises InputError if unreadable."""
    for no, obj in _json_lines(path):
        try:
            yield no, obj if isinstance(obj, InputError) else TextInput.from_json(obj)
        except InputError as exc:
            yield no, exc


def read_labelled_jsonl(path: Path, require_label: bool) -> Iterator[tuple[int, LabelledInput | InputError]]:
    """Like ``read_jsonl``, lines may also carry ``"label"``: a string, required when ``require_label``."""
    for no, obj in _json_lines(path):
        if isinstance(obj, InputError):
            yield no, obj
            continue
        try:
            label = obj.pop("label", None) if isinstance(obj, dict) else None
            if label is None and require_label:
                raise InputError("missing field 'label'")
            if label is not None and not isinstance(label, str):
                raise InputError(f"'label' must be a string, got {label!r}")
            yield no, LabelledInput(TextInput.from_json(obj), label)
        except InputError as exc:
            yield no, exc
