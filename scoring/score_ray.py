"""``fusionserve score --ray``: the same scoring on Ray Data, for a machine's every core or a cluster.

    read (``RowsDatasource``: the local path's readers, rows numbered)
      -> map_batches(ScoreBatches, one actor per CPU slot, ``chunk_size`` rows per call)
      -> iter_batches on the driver, in input order -> the local path's Sink (output, side file, progress file)

Each actor holds one ONNX Runtime session with ``threads`` intra-op threads and reserves as many CPUs, so the
actors together never ask for more cores than Ray has. ``preserve_order`` keeps the input order, and the driver
writes through the same Sink as the local path, so the output is the same file, row for row.

Why not ``read_json`` / ``read_csv`` / ``read_parquet``: the first two parse a whole file with pyarrow, so one
unparsable line fails the whole read, CSV values are re-typed ("007" becomes 7), and row numbers are lost; the
third (Ray 2.60) lists files in a task that asks for a whole CPU, which never starts while the actor pool holds
every slot. ``RowsDatasource`` reads with the local path's readers instead, and the actors parse with its
``parse``: bad rows reach the side file with their row numbers, and values pass through as they were.

Resume: a ``--ray`` run keeps the progress file up to date like a local run, but does not itself resume (Ray Data
has no cheap way to start reading at row N); it refuses an unfinished output, which a run without ``--ray``
finishes. The input file and the artifact folder must be readable at the same path on every node.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.datasource import FileBasedDatasource

from fusionserve.errors import InputError
from fusionserve.serving.model.artifact import Artifact
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.process.cluster import connect

from .config import ScoreConfig
from .core import Scored, score_records
from .readers import Record, Source, chunked, parse, raw_rows
from .sink import Sink

_PREFIX = "__fusionserve_"  # the columns we add beside the input's own
ROW, PAYLOAD, READ_ERROR = _PREFIX + "row", _PREFIX + "payload", _PREFIX + "read_error"


class RowsDatasource(FileBasedDatasource):
    """A file as blocks of ``chunk_size`` rows, read as the local path reads it, each row with its number
    (``__fusionserve_row``): JSONL lines and CSV field lists in ``__fusionserve_payload``, Parquet columns as
    they are."""

    def __init__(self, path: str, fmt: str, chunk_size: int, max_row_bytes: int) -> None:
        super().__init__(path)
        self.fmt, self.chunk_size, self.max_row_bytes = fmt, chunk_size, max_row_bytes

    def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> pa.NativeFile:
        if self.fmt == "parquet":  # Parquet needs random access (the footer first), not a stream
            return filesystem.open_input_file(path)
        return super()._open_input_source(filesystem, path, **open_args)

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        if self.fmt == "parquet":
            done = 0
            for batch in pq.ParquetFile(f).iter_batches(batch_size=self.chunk_size):
                rows = pa.array(range(done + 1, done + batch.num_rows + 1), pa.int64())
                done += batch.num_rows
                yield pa.Table.from_batches([batch]).append_column(ROW, rows)
            return
        kind = pa.binary() if self.fmt == "jsonl" else pa.list_(pa.string())
        for chunk in chunked(raw_rows(self.fmt, io.BufferedReader(f), path, self.max_row_bytes), self.chunk_size):
            bad = [isinstance(p, InputError) for _, p in chunk]  # a row too long, or not UTF-8: its reason goes along
            rows = pa.array([no for no, _ in chunk], pa.int64())
            payloads = pa.array([None if b else p for b, (_, p) in zip(bad, chunk, strict=True)], kind)
            errors = pa.array([str(p) if b else None for b, (_, p) in zip(bad, chunk, strict=True)], pa.string())
            yield pa.table({ROW: rows, PAYLOAD: payloads, READ_ERROR: errors})


class ScoreBatches:
    """The Ray Data callable class: one ONNX Runtime session per actor, ``score_records`` per batch."""

    def __init__(self, cfg: ScoreConfig, artifact: str, fmt: str, header: tuple[str, ...] | None) -> None:
        self.cfg, self.fmt, self.header = cfg, fmt, header
        # CPU only: Ray hides GPUs from an actor that did not reserve one
        self.runner = OnnxRunner(artifact, threads=cfg.threads or 1, device="cpu")

    def __call__(self, batch: pa.Table) -> pa.Table:
        cfg = self.cfg
        records = _records(batch, self.fmt, self.header, self.cfg.max_row_bytes)
        results = score_records(self.runner, cfg.tasks, records, cfg.fields, cfg.batch_size, cfg.activations, None,
                                cfg.truncation_direction, cfg.raw_scores, cfg.head_options())  # fmt: skip
        ok = [None if isinstance(r, InputError) else r for r in results]  # per row: one Scored per task
        nested = pa.list_(pa.list_(pa.float64()))
        columns = {  # a prediction's shape depends on its task's head: it travels as its JSON text
            "error": pa.array([str(r) if isinstance(r, InputError) else None for r in results], pa.string()),
            "prediction": pa.array([r and [json.dumps(s.prediction) for s in r] for r in ok], pa.list_(pa.string())),
            "acts": pa.array([r and [list(s.activations or ()) for s in r] for r in ok], nested),
            "truncated": pa.array([r and [s.truncated for s in r] for r in ok], pa.list_(pa.bool_())),
        }
        for name, values in columns.items():
            batch = batch.append_column(_PREFIX + name, values)
        return batch


def _records(batch: pa.Table, fmt: str, header: tuple[str, ...] | None, max_row_bytes: int) -> list[Record | InputError]:
    if fmt == "parquet":
        own = batch.select([c for c in batch.column_names if not c.startswith(_PREFIX)])
        return [parse(fmt, r, None, max_row_bytes) for r in own.to_pylist()]
    payloads, errors = batch.column(PAYLOAD).to_pylist(), batch.column(READ_ERROR).to_pylist()
    return [InputError(e) if e is not None else parse(fmt, p, header) for p, e in zip(payloads, errors, strict=True)]


def _results(batch: pa.Table, activations: bool) -> list[tuple[Scored, ...] | InputError]:
    cols = {name: batch.column(_PREFIX + name).to_pylist() for name in ("error", "prediction", "acts", "truncated")}
    out: list[tuple[Scored, ...] | InputError] = []
    for i, error in enumerate(cols["error"]):
        if error is not None:
            out.append(InputError(error))
            continue
        per_task = zip(cols["prediction"][i], cols["acts"][i], cols["truncated"][i], strict=True)
        out.append(tuple(Scored(json.loads(p), tuple(acts) if activations else None, cut) for p, acts, cut in per_task))
    return out


def score_with_ray(cfg: ScoreConfig, source: Source, artifact: Artifact, sink: Sink, on_rows: Callable[[int], Any]) -> None:
    """Score ``source`` on Ray Data into ``sink``, committing each batch as it arrives, in input order.
    Raises InputError when the input or artifact path is not readable by Ray, FusionServeError from the actors."""
    started = connect(cfg.ray_address)
    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars
    ctx.execution_options.preserve_order = True  # the output keeps the input order
    ctx.enable_progress_bars = False  # the driver shows one bar of its own
    try:
        threads = cfg.threads or 1
        actors = cfg.ray_actors or max(1, int(ray.cluster_resources().get("CPU", 1) // threads))
        path = str(Path(source.path).resolve())
        # Reading reserves no CPU: the actors hold every slot, and a read task waiting for one would wait forever.
        # (So no read_parquet either: in Ray 2.60 it lists files in a task that always asks for a whole CPU.)
        ds = ray.data.read_datasource(RowsDatasource(path, source.fmt, cfg.chunk_size, cfg.max_row_bytes), num_cpus=0)
        ds = ds.map_batches(
            ScoreBatches,
            fn_constructor_kwargs={"cfg": cfg, "artifact": str(artifact.folder), "fmt": source.fmt, "header": source.columns},
            batch_size=cfg.chunk_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=threads,
        )
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            n = batch.num_rows
            sink.write(
                batch.column(ROW).to_pylist(),
                _records(batch, source.fmt, source.columns, cfg.max_row_bytes),
                _results(batch, cfg.activations),
            )
            sink.commit(n)
            on_rows(n)
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        if started:
            ray.shutdown()
