"""Where scored chunks go: the output file, the bad-row side file (OUTPUT.errors.jsonl), and the progress file
that makes a run resumable. The local run and the Ray Data run write through the same ``Sink``, so their
outputs are the same file, row for row."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from fusionserve.errors import InputError
from fusionserve.serving.model.artifact import sha256

from .columns import Added
from .config import ScoreConfig
from .core import Scored
from .progress import Progress, side_files
from .readers import Record, Source
from .writers import CsvWriter, JsonlWriter, ParquetWriter

_SHOWN_ERRORS = 10  # bad rows echoed on stderr; all of them go to the side file


class Sink:
    """Writes scored chunks (rows, records, results) to the output and the side file, and commits them."""

    def __init__(
        self, cfg: ScoreConfig, source: Source, out_fmt: str, state: Progress, added: Added, say: Callable[[str], object]
    ) -> None:
        self.output = cfg.output_path
        self.errors_path, self.progress_path, parts = side_files(self.output)
        self.state, self.added, self.say = state, added, say
        columns = None if source.columns is None else [*source.columns, *added.names]
        if out_fmt == "jsonl":
            self.writer: JsonlWriter | CsvWriter | ParquetWriter = JsonlWriter(self.output, state.output_bytes)
        elif out_fmt == "csv":
            self.writer = CsvWriter(self.output, columns, state.output_bytes)
        else:
            schema = source.schema
            if schema is None and source.columns is not None:  # CSV: every value is a string
                schema = pa.schema([pa.field(c, pa.string()) for c in source.columns])
            self.writer = ParquetWriter(parts, schema, added.schema(), state.parts)
        self.errors: JsonlWriter | None = None
        if self.errors_path.exists() or state.errors_bytes:
            self.errors = JsonlWriter(self.errors_path, state.errors_bytes)

    def write(
        self, rows: Sequence[int], records: Sequence[Record | InputError], results: Sequence[tuple[Scored, ...] | InputError]
    ) -> None:
        """Write one chunk: the good rows with their added columns to the output, the bad ones to the side file."""
        if not len(rows) == len(records) == len(results):
            raise RuntimeError(f"{len(results)} results for {len(rows)} rows ({len(records)} records)")
        bad: list[tuple[int, str]] = []
        good_rows, good, cut = [], [], {}
        for no, record, result in zip(rows, records, results, strict=True):
            if isinstance(result, InputError) or isinstance(record, InputError):
                bad.append((no, str(result)))
                continue
            clash = next((c for c in self.added.names if c in record), None)
            if clash is not None:
                bad.append((no, f"field '{clash}' is there already; pass --prefix so the added columns get other names"))
                continue
            good_rows.append(no)
            good.append({**record, **self.added.values(result)})
            cut[no] = any(r.truncated for r in result)
        refused = self.writer.write(good_rows, good)
        self.state.scored += len(good_rows) - len(refused)
        self.state.truncated += sum(cut[no] for no in good_rows) - sum(cut[no] for no, _ in refused)
        bad += refused
        if not bad:
            return
        bad.sort()
        if self.errors is None:
            self.errors = JsonlWriter(self.errors_path, 0)
        self.errors.write([no for no, _ in bad], [{"row": no, "error": why} for no, why in bad])
        for no, why in bad:
            if self.state.failed < _SHOWN_ERRORS:
                self.say(f"row {no}: {why}")
            elif self.state.failed == _SHOWN_ERRORS:
                self.say(f"more bad rows: see {self.errors_path}")
            self.state.failed += 1

    def commit(self, rows: int) -> None:
        """Make the last ``rows`` input rows durable: output and side file first, then the progress file."""
        done = self.writer.commit()
        if isinstance(self.writer, ParquetWriter):
            self.state.parts = done
        else:
            self.state.output_bytes = done
        if self.errors is not None:
            self.state.errors_bytes = self.errors.commit()
        self.state.rows_done += rows
        self.state.save(self.progress_path)

    def finish(self) -> None:
        """The input is done: Parquet parts become the output, and the progress file says complete. A crash in
        between leaves the parts, and a rerun joins them again."""
        if isinstance(self.writer, ParquetWriter):
            self.writer.finish(self.output)
        self.state.complete = True
        self.state.final_bytes, self.state.final_sha256 = self.output.stat().st_size, sha256(self.output)
        self.state.save(self.progress_path)
        if isinstance(self.writer, ParquetWriter):
            self.writer.cleanup()

    def close(self) -> None:
        self.writer.close()
        if self.errors is not None:
            self.errors.close()
