"""Inputs read from JSON lines files (``predict --input``, ``calibrate``, ``evaluate``): one object per line,
``{"text": ..., "text_pair": ..., "id": ..., "label": ...}``; a bad line becomes the InputError that says why, and
the rest go on."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fusionserve.errors import InputError
from fusionserve.serving.predictions import TextInput

T = TypeVar("T")


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
