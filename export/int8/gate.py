"""The int8 gate: what an int8 graph must keep of its fp32 graph's answers (``Int8Gate``), and the check
(``check_int8``) that measures it over the export's validation grid and its batches mixing every task. Its figures go
to the manifest (``GateReport.as_dict``); ``quantize.int8_graph`` runs it before an int8 graph may become an artifact.

What "keeps the answer" means depends on what a caller reads of a head (``distributions``): a classification row's
label (softmax over its labels); a tagging row's label at every real token; a question-answering row's start and its
end, each a softmax over the row's real tokens (the span search reads them so, not as two labels); a multiple-choice
question's choice, a softmax over its choices (the rows of one grid batch of that task, read as the choices of one
question: a single row chooses nothing and is not counted). Each kind's share of units (rows, tokens, positions,
questions) that keep their argmax must reach ``min_label_agreement`` and its largest probability change stay within
``max_probability_change``. A regression head has no label and no probability: its values over the grid must keep a
Pearson correlation of at least ``min_regression_correlation`` with the fp32 graph's (STS-B and SICK-R are scored by
correlation); the largest change of a value is recorded, not gated (its scale is the target's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..model import OUTPUT, FusionModel
from ..validate import BATCH_SIZES, SEQ_LENS, ParityError, grid_inputs, max_diff, mixed_cases


class Int8GateError(ParityError):
    """The int8 graph departs from the fp32 graph beyond the gate; no artifact was written."""


@dataclass(frozen=True)
class Int8Gate:
    """Thresholds an int8 graph must meet against its fp32 graph over the validation grid (every task, every row).

    The grid's inputs are random token ids, which a trained model often finds ambiguous (top two labels close),
    so labels flip there more often than on real text. Each int8 variant's agreement over the grid is recorded beside
    its accuracy in benchmarks/RESULTS.md ("int8 accuracy (default model)", column "gate grid", and "int8 in every
    GEMM: smoothing and static QDQ (issue 28)"): the shipped options pass with room, every GEMM with per-tensor
    scales falls below the gate."""

    min_label_agreement: float = 0.85  # share of rows whose label equals the fp32 graph's
    max_probability_change: float = 0.3  # largest |p_int8 - p_fp32| of any label of any row
    min_regression_correlation: float = 0.95  # Pearson r of a regression head's values, int8 against fp32

    def __post_init__(self) -> None:
        for name in ("min_label_agreement", "max_probability_change", "min_regression_correlation"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


UNITS = {"tagging": "tokens", "question_answering": "start and end positions", "multiple_choice": "questions"}


@dataclass
class KindFigures:
    """One head kind's gate figures beyond classification: units (``UNITS``) whose argmax is unchanged, the largest
    probability change, or for regression the values of both graphs (``correlation``)."""

    units: int = 0
    agreeing: int = 0
    max_probability_change: float = 0.0
    worst: str = ""
    values: list[tuple[float, float]] = field(default_factory=list)  # regression: (fp32, int8) per row

    @property
    def agreement(self) -> float:
        return self.agreeing / self.units if self.units else 1.0

    @property
    def correlation(self) -> float:
        """Pearson r of the int8 values against the fp32 ones (1.0 when they are equal, or fewer than two rows)."""
        v = np.asarray(self.values, dtype=np.float64).reshape(-1, 2)
        if len(v) < 2 or np.array_equal(v[:, 0], v[:, 1]):
            return 1.0
        sd = v.std(axis=0)
        return float(np.corrcoef(v[:, 0], v[:, 1])[0, 1]) if sd.all() else 0.0

    def as_dict(self, kind: str) -> dict[str, Any]:
        if kind == "regression":
            change = float(np.abs(np.diff(np.asarray(self.values).reshape(-1, 2), axis=1)).max()) if self.values else 0.0
            return {"rows": len(self.values), "correlation": self.correlation, "max_abs_change": change}
        return {
            "units": UNITS[kind],
            "count": self.units,
            "agreement": self.agreement,
            "max_probability_change": self.max_probability_change,
            "worst_case": self.worst,
        }


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def distributions(kind: str, logits: np.ndarray, real: np.ndarray) -> np.ndarray:
    """What a caller's answer is read from, one probability distribution per unit (units, classes), for rows of one
    task: ``logits`` (rows, labels) or (rows, seq, labels) cut to the task's labels, ``real`` (rows, seq) its real
    tokens. See the module docstring; raises ValueError for regression (no distribution) or an unknown kind."""
    if kind == "classification":
        return _softmax(logits)  # (rows, labels)
    if kind == "tagging":
        return _softmax(logits[real])  # (tokens, labels)
    if kind == "question_answering":
        z = np.where(real[:, :, None], logits.astype(np.float64), -np.inf)  # (rows, seq, 2)
        return _softmax(z.transpose(0, 2, 1).reshape(-1, z.shape[1]))  # (rows x 2, seq)
    if kind == "multiple_choice":
        return _softmax(logits[:, 0][None]) if len(logits) > 1 else np.zeros((0, len(logits)))  # (1, choices)
    raise ValueError(f"no distribution for a {kind} head")


@dataclass
class GateReport:
    """The gate's figures over the grid; ``worst`` says where each extreme happened. The top-level figures are the
    classification rows'; ``heads`` holds every other kind's (``KindFigures``)."""

    gate: Int8Gate
    rows: int = 0
    agreeing: int = 0
    max_probability_change: float = 0.0
    max_fusion_activation_change: float = 0.0  # recorded, not gated: the adapters' weights per token
    worst: dict[str, str] = field(default_factory=dict)
    cases: int = 0
    heads: dict[str, KindFigures] = field(default_factory=dict)

    @property
    def label_agreement(self) -> float:
        return self.agreeing / self.rows if self.rows else 1.0

    def add(self, kind: str, want: np.ndarray, got: np.ndarray, real: np.ndarray, where: str) -> None:
        """Rows of one task of head ``kind``: fp32's and int8's outputs of its level cut to its labels, its real tokens."""
        if kind == "regression":
            self.heads.setdefault(kind, KindFigures()).values += list(zip(want[:, 0].tolist(), got[:, 0].tolist(), strict=True))
            return
        p_want, p_got = distributions(kind, want, real), distributions(kind, got, real)
        agreeing = int((p_want.argmax(-1) == p_got.argmax(-1)).sum()) if len(p_want) else 0
        change = (float(np.abs(p_got - p_want).max()) if np.isfinite(p_got).all() else float("inf")) if p_want.size else 0.0
        if kind == "classification":
            self.rows, self.agreeing = self.rows + len(p_want), self.agreeing + agreeing
            if change >= self.max_probability_change:
                self.max_probability_change, self.worst["probability"] = change, where
            return
        figures = self.heads.setdefault(kind, KindFigures())
        figures.units, figures.agreeing = figures.units + len(p_want), figures.agreeing + agreeing
        if change >= figures.max_probability_change:
            figures.max_probability_change, figures.worst = change, where

    def failures(self) -> list[str]:
        gate, bad = self.gate, []
        if not self.label_agreement >= gate.min_label_agreement:
            bad.append(
                f"  label agreement {self.label_agreement:.2%} ({self.agreeing} of {self.rows} rows) "
                f"< {gate.min_label_agreement:.2%}"
            )
        if not self.max_probability_change <= gate.max_probability_change:
            bad.append(
                f"  max probability change {self.max_probability_change:.3g} > {gate.max_probability_change:g} "
                f"at {self.worst.get('probability', '?')}"
            )
        for kind, f in self.heads.items():
            if kind == "regression":
                if not f.correlation >= gate.min_regression_correlation:
                    bad.append(
                        f"  regression: correlation with fp32 {f.correlation:.4f} over {len(f.values)} rows "
                        f"< {gate.min_regression_correlation:g}"
                    )
                continue
            if not f.agreement >= gate.min_label_agreement:
                bad.append(
                    f"  {kind}: agreement {f.agreement:.2%} ({f.agreeing} of {f.units} {UNITS[kind]}) "
                    f"< {gate.min_label_agreement:.2%}"
                )
            if not f.max_probability_change <= gate.max_probability_change:
                bad.append(
                    f"  {kind}: max probability change {f.max_probability_change:.3g} > {gate.max_probability_change:g} "
                    f"at {f.worst}"
                )
        return bad

    def as_dict(self) -> dict[str, Any]:
        out = {
            "thresholds": asdict(self.gate),
            "label_agreement": self.label_agreement,
            "rows": self.rows,
            "max_probability_change": self.max_probability_change,
            "max_fusion_activation_change": self.max_fusion_activation_change,
            "worst_case": self.worst,
            "cases": self.cases,
            "grid": {"batch_sizes": list(BATCH_SIZES), "sequence_lengths": list(SEQ_LENS), "padded": True},
            "reference": "the fp32 graph this one was quantized from (see 'parity')",
        }
        if self.heads:
            out["heads"] = {kind: f.as_dict(kind) for kind, f in self.heads.items()}
        return out


def gate_runs(model: FusionModel, max_seq_len: int, wanted: set[str]) -> list[tuple[str, np.ndarray, list[Any]]]:
    """(what, task_id feed, cases): every task over the whole grid, then (a graph that reads task_id per row, with more
    than one task) batches whose rows cycle through every task, as the fp32 parity gate runs them (``validate``)."""
    runs: list[tuple[str, np.ndarray, list[Any]]] = [
        (f"task {t}", np.array([i], dtype=np.int64), grid_inputs(model.backbone.vocab_size, max_seq_len))
        for t, i in model.task_index.items()
    ]
    if "task_id" in wanted:
        runs += [("mixed tasks", ids, [case]) for ids, case in mixed_cases(model, max_seq_len)]
    return runs


def compare_grid(
    candidate: Any, fp32: Any, model: FusionModel, max_seq_len: int, report: Any, progress: Callable[[int], None] | None = None
) -> None:
    """Run ``candidate`` and ``fp32`` over ``gate_runs`` and hand each task's rows of each case to
    ``report.add(head, want, got, real, where)`` (fp32's and the candidate's outputs of the task's level cut to its labels,
    its real tokens); the largest fusion-activation change, the case count and ``worst`` are kept on ``report`` too.
    The int8 gate and the bf16 gate (export/bf16.py) read the same cases this way."""
    wanted = {i.name for i in fp32.get_inputs()}
    outputs = list(model.outputs)
    infos = list(model.infos.values())  # task-index order
    for what, task_id, cases in gate_runs(model, max_seq_len, wanted):
        for batch, seq, feeds in cases:
            feed = {k: v for k, v in {**feeds, "task_id": task_id}.items() if k in wanted}
            want = dict(zip(outputs, fp32.run(outputs, feed), strict=True))
            got = dict(zip(outputs, candidate.run(outputs, feed), strict=True))
            rows = np.broadcast_to(task_id, (batch,))  # each row's task
            where = f"{what}, batch {batch}, sequence {seq}"
            for index in np.unique(rows):
                info, pick = infos[index], rows == index
                out, n = OUTPUT[info.level], len(info.labels)
                report.add(
                    info.head, want[out][pick][..., :n], got[out][pick][..., :n], feeds["attention_mask"][pick] == 1, where
                )
            acts = max_diff(got["fusion_activations"], want["fusion_activations"], feeds["attention_mask"][:, None, :, None] == 1)
            if acts >= report.max_fusion_activation_change:
                report.max_fusion_activation_change, report.worst["fusion_activations"] = acts, where
            report.cases += 1
            if progress is not None:
                progress(1)


def check_int8(
    int8: object,
    fp32: object,
    model: FusionModel,
    max_seq_len: int,
    gate: Int8Gate,
    progress: Callable[[int], None] | None = None,
) -> GateReport:
    """Compare the int8 session with the fp32 session (both onnxruntime.InferenceSession) for every task over the
    validation grid, and over batches mixing every task (``gate_runs``; ``validate.count_cases`` counts them all).
    Raises Int8GateError listing every figure that breaks ``gate``."""
    report = GateReport(gate)
    compare_grid(int8, fp32, model, max_seq_len, report, progress)
    bad = report.failures()
    if bad:
        raise Int8GateError(
            f"the int8 graph departs from the fp32 graph beyond the gate over {report.rows} rows "
            f"({report.cases} cases); no artifact written:\n" + "\n".join(bad)
        )
    return report
