"""Rows into JSON lines, CSV and Parquet files, a chunk at a time, each chunk committed to disk.

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
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fusionserve.errors import InputError

from .files import open_output
from .readers import Record, csv_header


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
        with open_output(path, "r+b", what="output") as fh:
            fh.truncate(size)


class _AppendFile:
    def __init__(self, path: Path, keep_bytes: int) -> None:
        _truncate(path, keep_bytes)
        self.path = path
        self.fh = open_output(path, "ab", what="output")

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


class _QuotingCsv:
    """Rows ending in \\n, with every field that holds a \\r or a \\n quoted: ``csv.writer`` quotes only the characters
    of its line terminator, so with ``"\\n"`` a field's lone \\r went out bare and split the row on reading back.
    Each row is written with the terminator ``"\\r\\n"`` (both characters quoted) into a buffer, then ends in \\n."""

    def __init__(self, text: io.TextIOBase) -> None:
        self._text, self._buffer = text, io.StringIO()
        self._csv = csv.writer(self._buffer, lineterminator="\r\n")

    def writerow(self, row: Sequence[object]) -> None:
        self._buffer.seek(0)
        self._buffer.truncate()
        self._csv.writerow(row)
        self._text.write(self._buffer.getvalue()[:-2] + "\n")


class CsvWriter(_AppendFile):
    """CSV with a header row; ``columns`` None: the keys of the first records written (JSONL input)."""

    def __init__(self, path: Path, columns: Sequence[str] | None, keep_bytes: int) -> None:
        super().__init__(path, keep_bytes)
        if keep_bytes:  # going on: the header already written decides the columns
            with path.open("rb") as fh:
                columns = csv_header(fh, path)
        self.columns = list(columns) if columns is not None else None
        self._text = io.TextIOWrapper(self.fh, encoding="utf-8", newline="", write_through=True)
        self._csv = _QuotingCsv(self._text)

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
