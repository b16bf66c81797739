"""Rows in and out of JSON lines, CSV and Parquet files, a chunk at a time: a file is never read whole.

Reading is two steps, so that Ray can run them in different places: ``raw_rows`` splits a file into (row number,
payload) — JSONL lines, CSV field lists, Parquet records — and ``parse`` turns a payload into a record (a dict)
or the InputError that row has. Row numbers start at 1: the line number for JSONL (blank lines are skipped but
counted), the data row after the header for CSV, the row for Parquet.

Writers append the rows of a chunk and ``commit`` them to disk (flushed and fsynced) so that a scoring run can
stop anywhere and go on later: JSONL and CSV grow in place; Parquet, which cannot be appended to, is written as
one part file per chunk in ``OUTPUT.parts/`` and joined into OUTPUT at the end. Columns of CSV and Parquet are
fixed by the input's header or schema, or for JSONL input by the first chunk; a later row that does not fit
them is refused (reported as a bad row), never silently cut.
"""

from __future__ import annotations

import base64
import csv
import datetime as dt
import decimal
import io
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from fusionserve.errors import InputError

from .predictions import TextInput

Record = dict[str, Any]
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet"}
_PARQUET_READ_ROWS = 4096  # rows decoded at a time: bounds memory whatever the file's row-group size
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
    """Check ``path`` and read its header or schema. Raises InputError when it is missing, unreadable, of an
    unknown format, or a CSV without a header row."""
    fmt = format_of(path)
    if not path.is_file():
        raise InputError(f"input file not found: {path}")
    try:
        with path.open("rb") as fh:
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


def csv_header(fh: BinaryIO, path: Path | str) -> tuple[str, ...]:
    """The first row of a CSV file. Raises InputError for an empty file or repeated column names."""
    header = next(csv.reader(_text(fh)), None)
    if not header:
        raise InputError(f"{path} has no header row (the first row names the columns)")
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise InputError(f"{path}: column name(s) {', '.join(map(repr, repeated))} appear more than once in the header")
    return tuple(header)


def _text(fh: BinaryIO) -> io.TextIOWrapper:
    # utf-8-sig: spreadsheet exports start with a byte-order mark; newline="" lets csv handle quoted line breaks
    return io.TextIOWrapper(fh, encoding="utf-8-sig", newline="")


def raw_rows(fmt: str, fh: BinaryIO, path: Path | str) -> Iterator[tuple[int, Any]]:
    """(row number, payload) for every row of an open file: the line (bytes) for JSONL, the fields for CSV, the
    record for Parquet. Raises InputError where the file itself is unreadable (CSV that is not UTF-8)."""
    if fmt == "jsonl":
        for no, line in enumerate(fh, start=1):
            if line.strip():
                yield no, line
    elif fmt == "csv":
        reader = csv.reader(_text(fh))
        no = 0
        try:
            next(reader, None)  # the header
            for no, fields in enumerate(reader, start=1):
                if fields:
                    yield no, fields
        except (UnicodeDecodeError, csv.Error) as exc:
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


def parse(fmt: str, payload: Any, header: Sequence[str] | None = None) -> Record | InputError:
    """A payload of ``raw_rows`` as a record, or the InputError saying why it is not one."""
    if fmt == "jsonl":
        try:
            obj = json.loads(payload)
        except UnicodeDecodeError:
            return InputError("not valid UTF-8")
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
    return payload


def to_input(record: Record, text_field: str, pair_field: str | None) -> TextInput | InputError:
    """The text (and pair) a record holds, or the InputError naming the field and what is wrong with it."""
    values: list[str | None] = []
    for name in (text_field, pair_field):
        if name is None:
            values.append(None)
            continue
        if name not in record:
            return InputError(f"missing field '{name}'")
        value = record[name]
        if value is None:
            return InputError(f"field '{name}' is null")
        if not isinstance(value, str):
            return InputError(f"field '{name}' must be a string, got {_kind(value)} {_short(value)}")
        if not value.strip():
            return InputError(f"field '{name}' is empty" if not value else f"field '{name}' is only whitespace")
        values.append(value)
    text, pair = values
    if text is None:
        raise ValueError("text_field is required")
    return TextInput(text, pair)


def _kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- writing ---------------------------------------------------------------------------------------------------


def json_value(value: Any) -> Any:
    """What JSON has no type for (Parquet timestamps, decimals, bytes) as a string."""
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=json_value)
    return str(value)


def _truncate(path: Path, size: int) -> None:
    """Cut ``path`` back to ``size`` bytes (what the last commit wrote): a half-written chunk goes. Raises
    InputError when the file is shorter than that: it was changed or replaced since."""
    have = path.stat().st_size if path.exists() else 0
    if have < size:
        raise InputError(
            f"{path} holds {have} bytes, but the unfinished run that wrote it committed {size}: it was changed since; "
            "pass --overwrite to start over"
        )
    if path.exists():
        with path.open("r+b") as fh:
            fh.truncate(size)


class _AppendFile:
    def __init__(self, path: Path, keep_bytes: int) -> None:
        _truncate(path, keep_bytes)
        self.path = path
        self.fh = path.open("ab")

    def commit(self) -> int:
        """Flush and fsync; returns the file's size, where a later run goes on."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        return self.fh.tell()

    def close(self) -> None:
        self.fh.close()


class JsonlWriter(_AppendFile):
    """One JSON object per line, every field kept."""

    def write(self, rows: Sequence[int], records: Sequence[Record]) -> list[tuple[int, str]]:
        """Append ``records``; returns the (row, reason) of those it could not write (none for JSONL)."""
        text = "".join(json.dumps(r, ensure_ascii=False, default=json_value) + "\n" for r in records)
        self.fh.write(text.encode("utf-8"))
        return []


def _misfits(record: Record, columns: Sequence[str], known: set[str], fmt: str) -> str | None:
    extra = [k for k in record if k not in known]
    if not extra:
        return None
    return (
        f"field(s) {', '.join(map(repr, extra))} are not among the {fmt} columns ({', '.join(columns)}), which the "
        "input's first chunk set; write JSONL to keep every field"
    )


class CsvWriter(_AppendFile):
    """CSV with a header row; ``columns`` None: the keys of the first records written (JSONL input)."""

    def __init__(self, path: Path, columns: Sequence[str] | None, keep_bytes: int) -> None:
        super().__init__(path, keep_bytes)
        if keep_bytes:  # going on: the header already written decides the columns
            with path.open("rb") as fh:
                columns = csv_header(fh, path)
        self.columns = list(columns) if columns is not None else None
        self._text = io.TextIOWrapper(self.fh, encoding="utf-8", newline="", write_through=True)
        self._csv = csv.writer(self._text, lineterminator="\n")

    def write(self, rows: Sequence[int], records: Sequence[Record]) -> list[tuple[int, str]]:
        """Append ``records``; returns the (row, reason) of those with fields outside the columns."""
        if self.columns is None:
            if not records:
                return []
            self.columns = list(dict.fromkeys(k for r in records for k in r))
        if self.fh.tell() == 0:
            self._csv.writerow(self.columns)
        known, refused = set(self.columns), []
        for no, record in zip(rows, records, strict=True):
            why = _misfits(record, self.columns, known, "CSV")
            if why:
                refused.append((no, why))
            else:
                self._csv.writerow([_cell(record.get(c)) for c in self.columns])
        return refused

    def commit(self) -> int:
        if self.columns is not None and self.fh.tell() == 0:  # every row so far was bad: still write the header
            self._csv.writerow(self.columns)
        self._text.flush()
        return super().commit()

    def close(self) -> None:
        self._text.close()


def _infer_schema(records: Sequence[Record], columns: Sequence[str]) -> pa.Schema:
    """Each column's type from its first non-null value; all-null columns become strings."""
    fields = []
    for name in columns:
        value = next((r[name] for r in records if r.get(name) is not None), None)
        kind = pa.string() if value is None else pa.array([value]).type
        fields.append(pa.field(name, kind))
    return pa.schema(fields)


class ParquetWriter:
    """One part file per chunk in ``parts_dir``, joined into the output by ``finish``. ``schema`` None: the types
    of the first records written (JSONL input); ``added`` is always appended to it."""

    def __init__(self, parts_dir: Path, schema: pa.Schema | None, added: pa.Schema, keep_parts: int) -> None:
        self.dir = parts_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        have = sorted(self.dir.glob("part-*.parquet"))
        if len(have) < keep_parts:
            raise InputError(
                f"{parts_dir} holds {len(have)} part file(s), but the unfinished run that wrote it committed {keep_parts}; "
                "pass --overwrite to start over"
            )
        for extra in have[keep_parts:]:  # written after the last commit: that chunk is scored again
            extra.unlink()
        self.parts = keep_parts
        self.schema = pq.read_schema(have[0]) if keep_parts else None
        if self.schema is None and schema is not None:
            self.schema = pa.schema([*schema, *added])
        self.added = added

    def _part(self, n: int) -> Path:
        return self.dir / f"part-{n:06d}.parquet"

    def write(self, rows: Sequence[int], records: Sequence[Record]) -> list[tuple[int, str]]:
        """Write ``records`` as the next part; returns the (row, reason) of those that do not fit the schema."""
        if self.schema is None:
            if not records:
                return []
            added = set(self.added.names)
            columns = list(dict.fromkeys(k for r in records for k in r if k not in added))
            self.schema = pa.schema([*_infer_schema(records, columns), *self.added])
        columns = self.schema.names
        known, refused, keep = set(columns), [], []
        for no, record in zip(rows, records, strict=True):
            why = _misfits(record, [c for c in columns if c not in self.added.names], known, "Parquet")
            if why:
                refused.append((no, why))
            else:
                keep.append((no, record))
        try:
            batch = pa.RecordBatch.from_pylist([r for _, r in keep], schema=self.schema)
        except (pa.ArrowException, TypeError, ValueError):
            # some row's value does not fit its column's type: find which, one row at a time
            fits = []
            for no, record in keep:
                try:
                    pa.RecordBatch.from_pylist([record], schema=self.schema)
                    fits.append(record)
                except (pa.ArrowException, TypeError, ValueError) as exc:
                    refused.append((no, f"does not fit the Parquet columns the first chunk set: {exc}"))
            batch = pa.RecordBatch.from_pylist(fits, schema=self.schema)
            refused.sort()
        if batch.num_rows:
            part, tmp = self._part(self.parts), self.dir / "part.tmp"
            pq.write_table(pa.Table.from_batches([batch]), tmp)
            with tmp.open("rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, part)
            self.parts += 1
        return refused

    def commit(self) -> int:
        """The number of parts written, each already complete on disk."""
        return self.parts

    def finish(self, output: Path) -> None:
        """Join the parts into ``output`` (part by part, so in bounded memory); the parts stay until ``cleanup``."""
        schema = self.schema if self.schema is not None else self.added
        tmp = output.with_name(output.name + ".tmp")
        with pq.ParquetWriter(tmp, schema) as writer:
            for n in range(self.parts):
                writer.write_table(pq.read_table(self._part(n), schema=schema))
        os.replace(tmp, output)

    def cleanup(self) -> None:
        shutil.rmtree(self.dir)

    def close(self) -> None:
        """Nothing stays open between parts."""
