"""Rows out of JSON lines, CSV and Parquet files, a chunk at a time: a file is never read whole.

Reading is two steps, so that Ray can run them in different places: ``raw_rows`` splits a file into (row number,
payload) — JSONL lines, CSV field lists, Parquet records — and ``parse`` turns a payload into a record (a dict)
or the InputError that row has. Row numbers start at 1: the line number for JSONL (blank lines are skipped but
counted), the data row after the header for CSV, the row for Parquet.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from fusionserve.errors import InputError
from fusionserve.serving.model.predictions import ChoiceInput, Input, QAInput, TextInput

from .files import MAX_ROW_BYTES, READ_BYTES, lines, not_utf8, open_input, too_long

Record = dict[str, Any]
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
_PARQUET_READ_ROWS = 4096  # rows decoded at a time: bounds memory whatever the file's row-group size
_ESCAPED = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as decoding with surrogateescape keeps it
# csv's default field limit (128 KiB) refuses long documents; the limit is module-global, so raise it once here
csv.field_size_limit(1 << 30)


def format_of(path: Path) -> str:
    """'jsonl', 'csv' or 'parquet' from the file's extension; raises InputError naming the known extensions."""
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        known = ", ".join(SUFFIXES)
        raise InputError(f"cannot tell the format of {path} from its extension {path.suffix!r}; known: {known}")
    return fmt


@dataclass(frozen=True)
class Source:
    """An input file, checked: its format and, for CSV and Parquet, its columns."""

    path: Path
    fmt: str
    columns: tuple[str, ...] | None  # CSV header or Parquet schema names; None for JSONL (fields vary by row)
    schema: pa.Schema | None  # Parquet only
    rows: int | None  # Parquet only (from the footer): the progress bar's total


def open_source(path: Path) -> Source:
    """Check ``path`` and read its header or schema. Raises InputError when it is missing, a folder, unreadable, not
    UTF-8 text (JSONL, CSV), of an unknown format, or a CSV without a header row."""
    fmt = format_of(path)
    try:
        with open_input(path, text=fmt != "parquet") as fh:
            if fmt == "csv":
                return Source(path, fmt, csv_header(fh, path), None, None)
            if fmt == "parquet":
                meta = pq.ParquetFile(fh).metadata
                schema = meta.schema.to_arrow_schema()
                return Source(path, fmt, tuple(schema.names), schema, meta.num_rows)
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror or exc}") from None
    except pa.ArrowException as exc:
        raise InputError(f"{path} is not a readable Parquet file: {exc}") from None
    return Source(path, fmt, None, None, None)


class _CsvLines:
    """The lines of a CSV file as text for ``csv.reader``, counting the bytes of the row being read (the reader
    pulls exactly the lines of one row before it yields it). Line ends are \\n, \\r\\n or a lone \\r, as csv expects.
    Bytes that are not UTF-8 pass as surrogate escapes, so that the row holding them is the one reported; a line
    over the limit is read through (``READ_BYTES`` characters at a time) and passes as an empty line."""

    def __init__(self, fh: BinaryIO, max_row_bytes: int) -> None:
        # utf-8-sig: spreadsheet exports start with a byte-order mark; newline="": line ends reach csv as they are
        self.text = io.TextIOWrapper(fh, encoding="utf-8-sig", errors="surrogateescape", newline="")
        self.max_row_bytes, self.row_bytes, self.cut = max_row_bytes, 0, False

    def _bytes(self, line: str) -> int:
        return len(line.encode("utf-8", "surrogateescape"))

    def __iter__(self) -> Iterator[str]:
        while line := self.text.readline(self.max_row_bytes + 1):
            size = self._bytes(line)
            if len(line) > self.max_row_bytes and not line.endswith(("\n", "\r")):
                while line and not line.endswith(("\n", "\r")):
                    line = self.text.readline(READ_BYTES)
                    size += self._bytes(line)
                self.row_bytes, self.cut = self.row_bytes + size, True
                yield "\n"
                continue
            self.row_bytes += size
            yield line

    def row_error(self, fields: Sequence[str]) -> InputError | None:
        """The error of the row just read (over the limit, or bytes that are not UTF-8); starts the next row."""
        size, cut, self.row_bytes, self.cut = self.row_bytes, self.cut, 0, False
        if cut or size > self.max_row_bytes:
            return too_long(size, self.max_row_bytes)
        for i, field in enumerate(fields, start=1):
            if _ESCAPED.search(field) is not None:
                raw = field.encode("utf-8", "surrogateescape")
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return InputError(f"field {i}: {not_utf8(raw, exc)}")
        return None


def csv_header(fh: BinaryIO, path: Path | str) -> tuple[str, ...]:
    """The first row of a CSV file. Raises InputError for an empty file, a header that is not UTF-8 or repeated
    column names."""
    text = _CsvLines(fh, MAX_ROW_BYTES)
    header = next(csv.reader(text), None)
    if not header:
        raise InputError(f"{path} has no header row (the first row names the columns)")
    bad = text.row_error(header)
    if bad is not None:
        raise InputError(f"{path}: the header row: {bad}")
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise InputError(f"{path}: column name(s) {', '.join(map(repr, repeated))} appear more than once in the header")
    return tuple(header)


def raw_rows(fmt: str, fh: BinaryIO, path: Path | str, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[tuple[int, Any]]:
    """(row number, payload) for every row of an open file: the line (bytes) for JSONL, the fields for CSV, the
    record for Parquet; a row over ``max_row_bytes`` or (CSV) not UTF-8 comes as its InputError instead, and the
    rows after it go on. Raises InputError where the file itself is unreadable (CSV the csv module refuses)."""
    if fmt == "jsonl":
        for no, line, size in lines(fh, max_row_bytes):
            if line is None:
                yield no, too_long(size, max_row_bytes)
            elif line.strip():
                yield no, line
    elif fmt == "csv":
        text = _CsvLines(fh, max_row_bytes)
        reader = csv.reader(text)
        no = 0
        try:
            next(reader, None)  # the header
            text.row_error(())
            for no, fields in enumerate(reader, start=1):
                bad = text.row_error(fields)
                if bad is not None:
                    yield no, bad
                elif fields:
                    yield no, fields
        except csv.Error as exc:
            raise InputError(f"{path}: cannot read data row {no + 1}: {exc}") from None
    else:
        no = 0
        for batch in pq.ParquetFile(fh).iter_batches(batch_size=_PARQUET_READ_ROWS):
            for record in batch.to_pylist():
                no += 1
                yield no, record


def chunked(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of ``size`` items (the last may be shorter)."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def parse(fmt: str, payload: Any, header: Sequence[str] | None = None, max_row_bytes: int = MAX_ROW_BYTES) -> Record | InputError:
    """A payload of ``raw_rows`` as a record, or the InputError saying why it is not one (a Parquet record's text
    and bytes values together over ``max_row_bytes`` included: Ray reads them without ``raw_rows``)."""
    if isinstance(payload, InputError):
        return payload
    if fmt == "jsonl":
        try:
            obj = json.loads(payload.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return not_utf8(payload, exc)
        except json.JSONDecodeError as exc:
            return InputError(f"not valid JSON: {exc.msg} (column {exc.colno})")
        if not isinstance(obj, dict):
            return InputError(f"expected a JSON object, got {_kind(obj)}")
        return obj
    if fmt == "csv":
        if header is None:
            raise ValueError("parsing CSV needs the header")
        if len(payload) != len(header):
            return InputError(f"has {len(payload)} field(s), the header has {len(header)}")
        return dict(zip(header, payload, strict=True))
    size = sum(len(v) for v in payload.values() if isinstance(v, (str, bytes)))
    return too_long(size, max_row_bytes) if size > max_row_bytes else payload


def to_input(record: Record, text_field: str, pair_field: str | None) -> TextInput | InputError:
    """The text (and pair) a record holds, or the InputError naming the field and what is wrong with it."""
    try:
        return TextInput(_string(record, text_field), None if pair_field is None else _string(record, pair_field))
    except InputError as exc:
        return exc


def _string(record: Record, name: str) -> str:
    """The text in field ``name``; raises InputError naming the field and what is wrong with it."""
    if name not in record:
        raise InputError(f"missing field '{name}'")
    value = record[name]
    if value is None:
        raise InputError(f"field '{name}' is null")
    if not isinstance(value, str):
        raise InputError(f"field '{name}' must be a string, got {_kind(value)} {_short(value)}")
    if not value.strip():
        raise InputError(f"field '{name}' is empty" if not value else f"field '{name}' is only whitespace")
    return value


def _choices(record: Record, name: str) -> list[Any]:
    """The list in field ``name`` (a list, or in a CSV cell a JSON array); raises InputError naming the field."""
    if name not in record or record[name] is None:
        raise InputError(f"missing field '{name}': a multiple-choice task reads its choices there")
    value = record[name]
    if isinstance(value, str):  # CSV: the cell holds the list as JSON
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InputError(
                f'field \'{name}\' must be a list of texts (in CSV: a JSON array such as ["yes", "no"]), got {_short(value)}'
            ) from None
    if not isinstance(value, (list, tuple)):
        raise InputError(f"field '{name}' must be a list of texts, got {_kind(value)} {_short(value)}")
    return list(value)


@dataclass(frozen=True)
class InputFields:
    """Where a record holds each part of an input: ``score``'s --text-field, --pair-field, --choices-field,
    --question-field and --context-field."""

    text: str = "text"
    pair: str | None = None
    choices: str = "choices"
    question: str = "question"
    context: str = "context"

    def read(self, record: Record, shape: type) -> Input:
        """The input of ``shape`` (TextInput, ChoiceInput, QAInput) ``record`` holds; raises InputError naming the field
        and what is wrong with it."""
        if shape is ChoiceInput:
            choices = _choices(record, self.choices)
            try:
                return ChoiceInput(_string(record, self.text), tuple(choices))
            except InputError as exc:  # named as the row names it: 'choices' -> the field's own name
                raise InputError(str(exc).replace("'choices", f"field '{self.choices}", 1)) from None
        if shape is QAInput:
            return QAInput(_string(record, self.question), _string(record, self.context))
        return TextInput(_string(record, self.text), None if self.pair is None else _string(record, self.pair))


def _kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
