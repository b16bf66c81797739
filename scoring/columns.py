"""The columns ``fusionserve score`` adds to each row, per task, shaped by the task's head (the same predictions as
POST /v1/classify, spread over columns), each with its Parquet type (CSV writes a list as JSON text, JSONL as JSON):

- classification: ``label``, ``score``; ``--all-scores``: ``score_<label>`` per label
- regression: ``score`` (the head's value)
- multiple choice: ``label`` (the chosen choice's text), ``choice`` (its index), ``score`` (its probability);
  ``--all-scores``: ``scores`` (per choice)
- tagging: ``tokens`` (a list of ``{entity, score, index, word, start, end}``), or with an aggregation strategy
  ``entities`` (a list of ``{entity_group, score, word, start, end}``)
- question answering: ``answer``, ``score``, ``start``, ``end`` (the best answer; empty when none qualifies); with
  ``--top-k`` above 1 also ``answers`` (the list)

and with ``--activations`` (fusion tasks) ``activation_<adapter>``. Each name is behind ``--prefix``; with several
tasks each task's columns come in turn, named ``<task>_label``, ``<task>_score``, ... (behind the prefix)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from fusionserve.serving.model.artifact import TaskEntry
from fusionserve.serving.model.heads import CLASSIFICATION, MULTIPLE_CHOICE, QUESTION_ANSWERING, REGRESSION, head

from .config import ScoreConfig
from .readers import Record

_SPAN = [("start", pa.int64()), ("end", pa.int64())]
_ENTITY = pa.struct([("entity_group", pa.string()), ("score", pa.float64()), ("word", pa.string()), *_SPAN])
_TOKEN = [("entity", pa.string()), ("score", pa.float64()), ("index", pa.int64()), ("word", pa.string()), *_SPAN]
_ANSWER = pa.struct([("answer", pa.string()), ("score", pa.float64()), *_SPAN])


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    value: Any  # prediction -> the column's value (a callable)


def _columns(entry: TaskEntry, cfg: ScoreConfig, p: str) -> list[Column]:
    """One task's columns (see the module docstring), named behind ``p``."""
    kind = head(entry)
    if kind == CLASSIFICATION:
        cols = [Column(f"{p}label", pa.string(), lambda r: r["label"]), Column(f"{p}score", pa.float64(), lambda r: r["score"])]
        if cfg.all_scores:
            cols += [Column(f"{p}score_{lab}", pa.float64(), lambda r, lab=lab: r["scores"][lab]) for lab in entry.labels]
        return cols
    if kind == REGRESSION:
        return [Column(f"{p}score", pa.float64(), lambda r: r["score"])]
    if kind == MULTIPLE_CHOICE:
        cols = [
            Column(f"{p}label", pa.string(), lambda r: r["label"]),
            Column(f"{p}choice", pa.int64(), lambda r: r["choice"]),
            Column(f"{p}score", pa.float64(), lambda r: r["scores"][r["choice"]]),
        ]
        return cols + ([Column(f"{p}scores", pa.list_(pa.float64()), lambda r: r["scores"])] if cfg.all_scores else [])
    if kind == QUESTION_ANSWERING:
        best = _best
        cols = [
            Column(f"{p}answer", pa.string(), lambda r: best(r).get("answer")),
            *(Column(f"{p}{k}", t, lambda r, k=k: best(r).get(k)) for k, t in [("score", pa.float64()), *_SPAN]),
        ]
        if (cfg.top_k or 1) > 1:
            cols.append(Column(f"{p}answers", pa.list_(_ANSWER), lambda r: r if isinstance(r, list) else [r]))
        return cols
    if cfg.aggregation_strategy not in (None, "none"):
        return [Column(f"{p}entities", pa.list_(_ENTITY), lambda r: r["entities"])]
    token = pa.struct([*_TOKEN, *([("scores", pa.map_(pa.string(), pa.float64()))] if cfg.raw_scores else [])])
    return [Column(f"{p}tokens", pa.list_(token), lambda r: _tokens(r["tokens"], cfg.raw_scores))]


def _best(prediction: Any) -> dict[str, Any]:
    """A question's best answer (the first of a top_k list); {} when none qualified."""
    if isinstance(prediction, list):
        return prediction[0] if prediction else {}
    return prediction or {}


def _tokens(tokens: list[dict[str, Any]], raw: bool) -> list[dict[str, Any]]:
    """Tagged tokens as Parquet's map type takes them (a token's ``scores`` as (label, logit) pairs)."""
    return [{**t, "scores": list(t["scores"].items())} for t in tokens] if raw else tokens


@dataclass(frozen=True)
class Added:
    """The columns a run adds (see the module docstring), per task in turn."""

    per_task: tuple[tuple[Column, ...], ...]
    activations: tuple[tuple[str, ...], ...]  # per task: its activation columns (none without --activations)

    @classmethod
    def of(cls, cfg: ScoreConfig, entries: Sequence[TaskEntry]) -> Added:
        per_task, acts = [], []
        for entry in entries:
            p = cfg.prefix if len(entries) == 1 else f"{cfg.prefix}{entry.name}_"
            per_task.append(tuple(_columns(entry, cfg, p)))
            acts.append(tuple(f"{p}activation_{a}" for a in entry.adapters) if cfg.activations else ())
        return cls(tuple(per_task), tuple(acts))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(
            n for cols, acts in zip(self.per_task, self.activations, strict=True) for n in [*(c.name for c in cols), *acts]
        )

    def values(self, results: Sequence[Any]) -> Record:
        """The added columns of one row from its per-task results (``core.Scored``)."""
        out: Record = {}
        for s, cols, acts in zip(results, self.per_task, self.activations, strict=True):
            out.update({c.name: c.value(s.prediction) for c in cols})
            if acts and s.activations is not None:
                out.update(zip(acts, s.activations, strict=True))
        return out

    def schema(self) -> pa.Schema:
        fields = []
        for cols, acts in zip(self.per_task, self.activations, strict=True):
            fields += [pa.field(c.name, c.type) for c in cols] + [pa.field(a, pa.float64()) for a in acts]
        return pa.schema(fields)
