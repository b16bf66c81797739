"""``fusionserve score``: offline batch scoring of a JSONL, CSV or Parquet file with an artifact, in constant memory,
resumable. No Ray here: ``--ray`` runs the same ``score_records`` in Ray Data actors (``score_ray.py``).

A run reads ``chunk_size`` rows at a time; within a chunk the rows are sorted by token length into batches of
``batch_size`` (so a batch pads little) and their results put back in input order. After each chunk the output
and the bad-row side file (OUTPUT.errors.jsonl: ``{"row": n, "error": why}``) are flushed and fsynced, then the
progress file OUTPUT.progress.json is replaced atomically; it records what the run is (input and model sha256,
task, options) and how far it got (rows done, bytes of output and side file, Parquet parts). A rerun with the same
output truncates both files to what the progress file says — a half-written chunk or a cut last line goes — and
goes on after the last committed row: no duplicates, no gaps. A progress file from another input, model, task or
option set is refused unless ``overwrite``.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from fusionserve.errors import InputError

from .artifact import MANIFEST, Artifact, TaskEntry, is_artifact, load_artifact, sha256
from .predictions import TextInput, label_scores
from .progress import Progress, prepare, side_files
from .runtime import OnnxRunner
from .tabular import CsvWriter, JsonlWriter, ParquetWriter, Record, Source, format_of, open_source, parse, raw_rows, to_input

_SHOWN_ERRORS = 10  # bad rows echoed on stderr; all of them go to the side file


@dataclass(frozen=True)
class ScoreConfig:
    """What ``fusionserve score`` does; ``output`` None: ``<input stem>.scored<input suffix>`` beside the input."""

    model: Path
    task: str
    input: Path
    output: Path | None = None
    text_field: str = "text"
    pair_field: str | None = None
    batch_size: int = 32
    chunk_size: int = 1024
    all_scores: bool = False
    activations: bool = False
    prefix: str = ""
    threads: int | None = None
    overwrite: bool = False
    progress: bool = True
    ray: bool = False
    ray_address: str | None = None
    ray_actors: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "chunk_size", "threads", "ray_actors"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if not self.text_field:
            raise InputError("--text-field must name a field")
        if self.pair_field == self.text_field:
            raise InputError(f"--pair-field must differ from --text-field, both are '{self.text_field}'")
        if self.ray_actors is not None and not self.uses_ray:
            raise InputError("--ray-actors needs --ray or --ray-address")
        if self.output_path.resolve() == self.input.resolve():
            raise InputError(f"--output must differ from --input, both are {self.input}")

    @property
    def output_path(self) -> Path:
        return self.output if self.output is not None else self.input.with_name(f"{self.input.stem}.scored{self.input.suffix}")

    @property
    def uses_ray(self) -> bool:
        return self.ray or self.ray_address is not None


# --- scoring: shared by the local loop and the Ray actors -------------------------------------------------------


@dataclass(frozen=True)
class Scored:
    label: str
    score: float  # probability of ``label``
    scores: tuple[float, ...]  # every label's probability, label-id order
    activations: tuple[float, ...] | None  # per task adapter: mean fusion weight over layers and real tokens
    truncated: bool


def mean_activations(acts: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(batch, task adapters): each adapter's fusion weight averaged over the row's real tokens, then over layers
    (each layer's weights sum to 1, so a row's values do too)."""
    m = mask[:, None, :, None].astype(np.float64)  # (batch, 1, seq, 1)
    per_layer = (acts * m).sum(axis=2) / np.maximum(m.sum(axis=2), 1.0)  # (batch, layers, adapters)
    return np.round(per_layer.mean(axis=1), 6)


def score_inputs(
    runner: OnnxRunner,
    task: str,
    inputs: Sequence[TextInput],
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
) -> list[Scored]:
    """Score ``inputs`` in batches of similar token length; results in input order. Raises what the runner
    raises (unknown task, no fusion for activations, runtime failure)."""
    labels = runner.artifact.task(task).labels
    if not inputs:  # a chunk whose rows were all bad
        return []
    # tokenized once: the lengths to sort by, and every batch a slice of it padded to its own longest
    encoded = runner.encoder.encode(inputs)
    lengths = encoded.attention_mask.sum(axis=1)
    order = sorted(range(len(inputs)), key=lengths.__getitem__)
    out: list[Scored | None] = [None] * len(inputs)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = encoded.rows(idx)
        res = runner.run(task, enc, return_fusion_activations=activations)
        acts = None
        if res.fusion_activations is not None:
            acts = mean_activations(res.fusion_activations, enc.attention_mask)  # (batch, task adapters)
        for k, (i, (label, score, probs)) in enumerate(zip(idx, label_scores(labels, res.logits), strict=True)):
            row_acts = None if acts is None else tuple(float(v) for v in acts[k])
            out[i] = Scored(label, score, tuple(probs.values()), row_acts, enc.truncated[k])
        if on_rows is not None:
            on_rows(len(idx))
    if any(s is None for s in out):
        raise RuntimeError(f"scored {sum(s is not None for s in out)} of {len(out)} inputs")
    return [s for s in out if s is not None]


def score_records(
    runner: OnnxRunner,
    task: str,
    records: Sequence[Record | InputError],
    text_field: str,
    pair_field: str | None,
    batch_size: int,
    activations: bool = False,
    on_rows: Callable[[int], object] | None = None,
) -> list[Scored | InputError]:
    """One result per record, in order: its Scored, or the InputError of a row that has no usable text."""
    inputs = [r if isinstance(r, InputError) else to_input(r, text_field, pair_field) for r in records]
    texts = [x for x in inputs if isinstance(x, TextInput)]
    scored = iter(score_inputs(runner, task, texts, batch_size, activations, on_rows))
    return [x if isinstance(x, InputError) else next(scored) for x in inputs]


# --- the added columns ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Added:
    """Columns a run adds to each row: ``label``, ``score``, then ``score_<label>`` (all scores) and
    ``activation_<adapter>`` (activations), each name behind ``prefix``."""

    names: tuple[str, ...]
    n_scores: int
    n_acts: int

    @classmethod
    def of(cls, cfg: ScoreConfig, entry: TaskEntry) -> Added:
        p = cfg.prefix
        scores = [f"{p}score_{lab}" for lab in entry.labels] if cfg.all_scores else []
        acts = [f"{p}activation_{a}" for a in entry.adapters] if cfg.activations else []
        return cls((f"{p}label", f"{p}score", *scores, *acts), len(scores), len(acts))

    def values(self, s: Scored) -> Record:
        vals: list[Any] = [s.label, s.score]
        if self.n_scores:
            vals += s.scores
        if self.n_acts and s.activations is not None:
            vals += s.activations
        return dict(zip(self.names, vals, strict=True))

    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(self.names[0], pa.string())] + [pa.field(n, pa.float64()) for n in self.names[1:]])


# --- the output files ------------------------------------------------------------------------------------------


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

    def write(self, rows: Sequence[int], records: Sequence[Record | InputError], results: Sequence[Scored | InputError]) -> None:
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
            cut[no] = result.truncated
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
        self.state.save(self.progress_path)
        if isinstance(self.writer, ParquetWriter):
            self.writer.cleanup()

    def close(self) -> None:
        self.writer.close()
        if self.errors is not None:
            self.errors.close()


# --- the run --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScoreSummary:
    output: Path
    errors: Path | None  # the side file, when some rows were bad
    rows: int  # input rows done over every run, bad ones included
    scored: int
    failed: int
    truncated: int
    resumed_from: int  # rows done before this run
    seconds: float  # this run
    complete: bool  # False: stopped early (``max_rows``); a rerun goes on

    def render(self) -> str:
        now = self.rows - self.resumed_from
        parts = [f"scored {self.scored} of {self.rows} rows into {self.output}"]
        if self.complete and not now and self.resumed_from:
            parts.append("already complete, nothing to do")
        else:
            if self.resumed_from:
                parts.append(f"resumed after {self.resumed_from} rows")
            rate = f" ({now / self.seconds:.1f} rows/s)" if self.seconds > 0 and now else ""
            parts.append(f"{now} rows in {self.seconds:.1f} s this run{rate}")
        if self.failed:
            parts.append(f"{self.failed} bad row{'s' if self.failed != 1 else ''} listed in {self.errors}")
        if self.truncated:
            parts.append(f"{self.truncated} text{'s' if self.truncated != 1 else ''} cut to the model's token limit")
        if not self.complete:
            parts.append("stopped early: run the same command again to go on")
        return "; ".join(parts)


def _run_identity(cfg: ScoreConfig, artifact: Artifact, out_fmt: str) -> dict[str, Any]:
    """What must match for a rerun to go on where an earlier one stopped (paths may change, contents may not)."""
    return {
        "input_sha256": sha256(cfg.input),
        "model_sha256": sha256(artifact.folder / MANIFEST),  # the manifest holds every model file's sha256
        "task": cfg.task,
        "text_field": cfg.text_field,
        "pair_field": cfg.pair_field,
        "all_scores": cfg.all_scores,
        "activations": cfg.activations,
        "prefix": cfg.prefix,
        "output_format": out_fmt,
    }


def _holds_strings(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):  # a categorical column: its values count
        kind = kind.value_type
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind))


def _check_columns(cfg: ScoreConfig, source: Source, added: Added) -> None:
    """Fail before scoring when the text field is nowhere or an added column is taken. For JSONL, whose fields vary
    by row, the first chunk stands for the file. Raises InputError."""
    where = str(cfg.input)
    if source.columns is not None:
        cols, seen = set(source.columns), f"; columns: {', '.join(source.columns)}"
    else:
        with cfg.input.open("rb") as fh:
            sample = [parse("jsonl", p) for _, p in itertools.islice(raw_rows("jsonl", fh, cfg.input), cfg.chunk_size)]
        records = [r for r in sample if not isinstance(r, InputError)]
        if not records:
            return  # nothing parsable to judge by: every row will be reported
        cols = {k for r in records for k in r}
        seen = f"; fields seen: {', '.join(sorted(cols))}"
        where = f"the first {len(sample)} rows of {cfg.input}"
    for flag, name in (("--text-field", cfg.text_field), ("--pair-field", cfg.pair_field)):
        if name is not None and name not in cols:
            raise InputError(f"{flag} '{name}' not found in {where}{seen}")
        if name is not None and source.schema is not None:
            kind = source.schema.field(name).type
            if not _holds_strings(kind):
                raise InputError(f"{flag} '{name}' of {cfg.input} is a {kind} column; it must hold strings")
    clash = [c for c in added.names if c in cols]
    if clash:
        raise InputError(
            f"{where} already has {', '.join(map(repr, clash))}; pass --prefix (e.g. --prefix pred_) so the added columns get other names"
        )


def _open_model(model: Path) -> Artifact:
    if not is_artifact(model):
        raise InputError(
            f"{model} is not an artifact folder (no {MANIFEST}); `fusionserve score` runs artifacts on ONNX Runtime: "
            "make one with `fusionserve export SPEC --out DIR`"
        )
    return load_artifact(model)


def score_file(cfg: ScoreConfig, max_rows: int | None = None) -> ScoreSummary:
    """Score ``cfg.input`` into ``cfg.output_path``, going on from where an earlier run of the same job stopped.
    ``max_rows``: stop after that many rows this run (a later call goes on; local path only).

    Raises InputError (bad options, missing or unknown-format files, a text field that is not there, an output
    another run wrote), ArtifactError (unknown task, bad artifact) and FusionServeError (runtime failures); bad rows
    are not errors: they go to the side file and are counted in the summary."""
    from tqdm import tqdm

    source = open_source(cfg.input)
    out_fmt = format_of(cfg.output_path)
    artifact = _open_model(cfg.model)
    entry = artifact.task(cfg.task)
    if cfg.activations and entry.kind != "fusion":
        raise InputError(f"--activations: task '{cfg.task}' has no fusion layer ({entry.kind} task)")
    if max_rows is not None and cfg.uses_ray:
        raise InputError("max_rows stops a local run; --ray does not resume")
    added = Added.of(cfg, entry)
    _check_columns(cfg, source, added)
    state = prepare(cfg.output_path, _run_identity(cfg, artifact, out_fmt), cfg.overwrite, str(cfg.input), str(artifact.folder))
    resumed_from, started = state.rows_done, time.perf_counter()
    errors_path = side_files(cfg.output_path)[0]
    if state.complete:
        return ScoreSummary(cfg.output_path, errors_path if state.failed else None, state.rows_done, state.scored,
                            state.failed, state.truncated, resumed_from, 0.0, True)  # fmt: skip
    if cfg.uses_ray and state.rows_done:
        raise InputError(
            f"--ray does not resume: {cfg.output_path} holds an unfinished run ({state.rows_done} rows done); "
            "rerun without --ray to finish it, or pass --overwrite to start over"
        )
    runner = None if cfg.uses_ray else OnnxRunner(artifact, threads=cfg.threads)
    bar = tqdm(desc=f"score {cfg.task}", unit="row", total=source.rows, initial=state.rows_done, file=sys.stderr,
               disable=not cfg.progress, dynamic_ncols=True)  # fmt: skip
    sink = Sink(cfg, source, out_fmt, state, added, lambda text: bar.write(text, file=sys.stderr))
    try:
        if runner is None:
            from .score_ray import score_with_ray

            score_with_ray(cfg, source, artifact, sink, bar.update)
            exhausted = True
        else:
            exhausted = _score_local(cfg, source, runner, sink, bar.update, max_rows)
        if exhausted:
            sink.finish()
    finally:
        sink.close()
        bar.close()
    return ScoreSummary(cfg.output_path, errors_path if state.failed else None, state.rows_done, state.scored,
                        state.failed, state.truncated, resumed_from, time.perf_counter() - started, state.complete)  # fmt: skip


def _score_local(
    cfg: ScoreConfig, source: Source, runner: OnnxRunner, sink: Sink, on_rows: Callable[[int], object], max_rows: int | None
) -> bool:
    """Chunk by chunk, each committed before the next is read; True when the input is exhausted."""
    with source.path.open("rb") as fh:
        rows = itertools.islice(raw_rows(source.fmt, fh, source.path), sink.state.rows_done, None)
        left = max_rows
        while left is None or left > 0:
            chunk = list(itertools.islice(rows, cfg.chunk_size if left is None else min(cfg.chunk_size, left)))
            if not chunk:
                return True
            records = [parse(source.fmt, payload, source.columns) for _, payload in chunk]
            results = score_records(
                runner, cfg.task, records, cfg.text_field, cfg.pair_field, cfg.batch_size, cfg.activations, on_rows
            )
            sink.write([no for no, _ in chunk], records, results)
            sink.commit(len(chunk))
            on_rows(sum(isinstance(r, InputError) for r in results))
            if left is not None:
                left -= len(chunk)
        return next(rows, None) is None
