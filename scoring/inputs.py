"""Inputs read from JSON lines files (``predict --input``, ``calibrate``, ``evaluate``): one object per line,
``{"text": ..., "text_pair": ..., "id": ..., "label": ...}`` (``predict`` also reads ``{"text", "choices"}`` and
``{"question", "context"}``, the inputs of multiple-choice and question-answering tasks); a bad line becomes the
InputError that says why, and the rest go on."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fusionserve.errors import InputError
from fusionserve.serving.model.predictions import Input, TextInput, read_input

from .files import MAX_ROW_BYTES, lines, not_utf8, open_input, too_long

T = TypeVar("T")


@dataclass(frozen=True)
class LabelledInput:
    """An input with its expected label (None in an unlabelled file)."""

    input: TextInput
    label: str | None


def json_lines(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object or the InputError of that line); blank lines are skipped. The file is opened
    now: raises InputError when it is missing, a folder, unreadable or not UTF-8 text (``files.open_input``)."""
    handle = open_input(path)

    def rows() -> Iterator[tuple[int, Any]]:
        with handle:
            for no, line, size in lines(handle, max_row_bytes):
                if line is None:
                    yield no, too_long(size, max_row_bytes)
                    continue
                if not line.strip():
                    continue
                try:
                    yield no, json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    yield no, not_utf8(line, exc)
                except json.JSONDecodeError as exc:
                    yield no, InputError(f"not valid JSON: {exc.msg} (column {exc.colno})")

    return rows()


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


def read_jsonl(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[tuple[int, Input | InputError]]:
    """(line number, input of any shape, or the error that line has); blank lines are skipped. Raises InputError,
    now, if the file is unreadable."""
    return _inputs(json_lines(path, max_row_bytes))


def _inputs(objects: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Input | InputError]]:
    for no, obj in objects:
        try:
            yield no, obj if isinstance(obj, InputError) else read_input(obj)
        except InputError as exc:
            yield no, exc


def read_labelled_jsonl(path: Path, require_label: bool) -> Iterator[tuple[int, LabelledInput | InputError]]:
    """Like ``read_jsonl``, lines may also carry ``"label"``: a string, required when ``require_label``."""
    return _labelled(json_lines(path), require_label)


def _labelled(objects: Iterator[tuple[int, Any]], require_label: bool) -> Iterator[tuple[int, LabelledInput | InputError]]:
    for no, obj in objects:
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
