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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fusionserve.errors import InputError
from fusionserve.serving.model.artifact import MANIFEST, Artifact, TaskEntry, is_artifact, load_artifact, sha256
from fusionserve.serving.model.heads import CLASSIFICATION, MULTIPLE_CHOICE, QUESTION_ANSWERING, REGRESSION, as_flag, head
from fusionserve.serving.model.runtime import OnnxRunner

from .columns import Added
from .config import ScoreConfig
from .core import score_records
from .files import check_output, model_files, open_input
from .progress import Progress, prepare, side_files
from .readers import Source, format_of, open_source, parse, raw_rows
from .sink import Sink


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
        "task": cfg.task if isinstance(cfg.task, str) else list(cfg.task),
        "text_field": cfg.text_field,
        "pair_field": cfg.pair_field,
        "all_scores": cfg.all_scores,
        "activations": cfg.activations,
        "prefix": cfg.prefix,
        # only when chosen: a run started before these options existed resumes as it was
        **({"truncation_direction": cfg.truncation_direction} if cfg.truncation_direction != "right" else {}),
        **({"raw_scores": True} if cfg.raw_scores else {}),
        **{k: v for k, v in _head_fields(cfg).items() if v is not None},
        "output_format": out_fmt,
    }


_HEAD_FIELDS = ("choices_field", "question_field", "context_field", "aggregation_strategy", "top_k", "max_answer_len",
                "handle_impossible_answer", "doc_stride")  # fmt: skip


def _head_fields(cfg: ScoreConfig) -> dict[str, Any]:
    """The options of heads beyond classification where they differ from their defaults: a run started before they
    existed resumes as it was."""
    defaults = ScoreConfig.__dataclass_fields__
    return {k: getattr(cfg, k) for k in _HEAD_FIELDS if getattr(cfg, k) != defaults[k].default}


def _fields_read(cfg: ScoreConfig, entries: list[TaskEntry]) -> list[tuple[str, str, bool]]:
    """(flag, field, holds text) of every field the tasks' heads read from a row."""
    kinds = {head(e) for e in entries}
    out = []
    if kinds - {QUESTION_ANSWERING}:
        out.append(("--text-field", cfg.text_field, True))
    if cfg.pair_field is not None:
        out.append(("--pair-field", cfg.pair_field, True))
    if MULTIPLE_CHOICE in kinds:
        out.append(("--choices-field", cfg.choices_field, False))
    if QUESTION_ANSWERING in kinds:
        out += [("--question-field", cfg.question_field, True), ("--context-field", cfg.context_field, True)]
    return out


def _check_heads(cfg: ScoreConfig, entries: list[TaskEntry], max_length: int) -> None:
    """What the tasks' heads make of the job's options, before anything is read. Raises InputError naming the option."""
    pairs = [e for e in entries if head(e) in (CLASSIFICATION, REGRESSION)]
    if cfg.pair_field is not None and len(pairs) < len(entries):
        other = next(e for e in entries if e not in pairs)
        raise InputError(
            f"--pair-field: task '{other.name}' is {head(other)}; only classification and regression tasks read a text pair"
        )
    try:
        cfg.head_options().check(entries, cfg.raw_scores, max_length)
    except InputError as exc:
        raise as_flag(exc) from None


def _holds_strings(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):  # a categorical column: its values count
        kind = kind.value_type
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind))


def _check_columns(cfg: ScoreConfig, source: Source, added: Added, entries: list[TaskEntry]) -> None:
    """Fail before scoring when a field the tasks read is nowhere or an added column is taken. For JSONL, whose fields
    vary by row, the first chunk stands for the file. Raises InputError."""
    where = str(cfg.input)
    if source.columns is not None:
        cols, seen = set(source.columns), f"; columns: {', '.join(source.columns)}"
    else:
        with open_input(cfg.input) as fh:
            rows = itertools.islice(raw_rows("jsonl", fh, cfg.input, cfg.max_row_bytes), cfg.chunk_size)
            sample = [parse("jsonl", p) for _, p in rows]
        records = [r for r in sample if not isinstance(r, InputError)]
        if not records:
            return  # nothing parsable to judge by: every row will be reported
        cols = {k for r in records for k in r}
        seen = f"; fields seen: {', '.join(sorted(cols))}"
        where = f"the first {len(sample)} rows of {cfg.input}"
    for flag, name, text in _fields_read(cfg, entries):
        if name not in cols:
            raise InputError(f"{flag} '{name}' not found in {where}{seen}")
        if text and source.schema is not None:
            kind = source.schema.field(name).type
            if not _holds_strings(kind):
                raise InputError(f"{flag} '{name}' of {cfg.input} is a {kind} column; it must hold strings")
    clash = [c for c in added.names if c in cols]
    if clash:
        raise InputError(
            f"{where} already has {', '.join(map(repr, clash))}; pass --prefix (e.g. --prefix pred_) so the added columns get other names"
        )


def _rows_in(path: Path, fmt: str) -> int:
    """Rows an output holds now (JSON lines, CSV data rows, Parquet rows)."""
    if fmt == "parquet":
        return int(pq.ParquetFile(path).metadata.num_rows)
    with path.open("rb") as fh:
        return sum(1 for _ in raw_rows(fmt, fh, path))


def _check_finished(out: Path, fmt: str, state: Progress) -> None:
    """A finished run's output must still be what it wrote: "already complete" over a cut or edited file would
    claim rows it no longer holds. Raises InputError saying what differs and how to start over."""
    if not state.final_sha256:  # a progress file from before these were recorded: nothing to compare with
        return
    if not out.is_file():
        now = "is gone"
    elif out.stat().st_size == state.final_bytes and sha256(out) == state.final_sha256:
        return
    else:
        try:
            rows = f"{_rows_in(out, fmt)} rows"
        except (InputError, OSError, pa.ArrowException):
            rows = "rows that cannot be read"
        now = f"holds {out.stat().st_size} bytes and {rows}"
    raise InputError(
        f"{out} was finished by an earlier run with {state.scored} scored rows in {state.final_bytes} bytes, but it {now}: "
        "it was cut or changed since; pass --overwrite to score the input again"
    )


def _open_model(model: Path) -> Artifact:
    if not is_artifact(model):
        raise InputError(
            f"{model} is not an artifact folder (no {MANIFEST}); `fusionserve score` runs artifacts on ONNX Runtime: "
            "make one with `fusionserve export SPEC --out DIR`"
        )
    return load_artifact(model)


def _check_outputs(cfg: ScoreConfig) -> None:
    """The output and its side files are none of the job's inputs and can be written. Raises InputError."""
    inputs = [cfg.input, *model_files(cfg.model)]
    errors, progress, _ = side_files(cfg.output_path)
    check_output(cfg.output_path, inputs)
    for path in (errors, progress):
        check_output(path, inputs, f"{cfg.output_path.name}'s side file")


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
    entries = [artifact.task(t) for t in cfg.tasks]
    plain = [e for e in entries if e.kind != "fusion"]
    if cfg.activations and plain:
        raise InputError(f"--activations: task '{plain[0].name}' has no fusion layer ({plain[0].kind} task)")
    if max_rows is not None and cfg.uses_ray:
        raise InputError("max_rows stops a local run; --ray does not resume")
    _check_heads(cfg, entries, artifact.max_seq_len)
    added = Added.of(cfg, entries)
    _check_columns(cfg, source, added, entries)
    _check_outputs(cfg)
    state = prepare(cfg.output_path, _run_identity(cfg, artifact, out_fmt), cfg.overwrite, str(cfg.input), str(artifact.folder))
    resumed_from, started = state.rows_done, time.perf_counter()
    errors_path = side_files(cfg.output_path)[0]
    if state.complete:
        _check_finished(cfg.output_path, out_fmt, state)
        return ScoreSummary(cfg.output_path, errors_path if state.failed else None, state.rows_done, state.scored,
                            state.failed, state.truncated, resumed_from, 0.0, True)  # fmt: skip
    if cfg.uses_ray and state.rows_done:
        raise InputError(
            f"--ray does not resume: {cfg.output_path} holds an unfinished run ({state.rows_done} rows done); "
            "rerun without --ray to finish it, or pass --overwrite to start over"
        )
    runner = None if cfg.uses_ray else OnnxRunner(artifact, threads=cfg.threads)
    bar = tqdm(desc=f"score {', '.join(cfg.tasks)}", unit="row", total=source.rows, initial=state.rows_done, file=sys.stderr,
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
    with open_input(source.path, text=source.fmt != "parquet") as fh:
        rows = itertools.islice(raw_rows(source.fmt, fh, source.path, cfg.max_row_bytes), sink.state.rows_done, None)
        left = max_rows
        while left is None or left > 0:
            chunk = list(itertools.islice(rows, cfg.chunk_size if left is None else min(cfg.chunk_size, left)))
            if not chunk:
                return True
            records = [parse(source.fmt, payload, source.columns, cfg.max_row_bytes) for _, payload in chunk]
            results = score_records(
                runner, cfg.tasks, records, cfg.fields, cfg.batch_size, cfg.activations, on_rows, cfg.truncation_direction,
                cfg.raw_scores, cfg.head_options(),
            )  # fmt: skip
            sink.write([no for no, _ in chunk], records, results)
            sink.commit(len(chunk))
            on_rows(sum(isinstance(r, InputError) for r in results))
            if left is not None:
                left -= len(chunk)
        return next(rows, None) is None
