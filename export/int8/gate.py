"""The int8 gate: what an int8 graph must keep of its fp32 graph's answers (``Int8Gate``), and the check
(``check_int8``) that measures it over the export's validation grid and its batches mixing every task. Its figures go
to the manifest (``GateReport.as_dict``); ``quantize.int8_graph`` runs it before an int8 graph may become an artifact."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..model import FusionModel
from ..validate import BATCH_SIZES, SEQ_LENS, ParityError, grid_inputs, mixed_cases


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

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_label_agreement <= 1.0:
            raise ValueError(f"min_label_agreement must be in [0, 1], got {self.min_label_agreement}")
        if not 0.0 <= self.max_probability_change <= 1.0:
            raise ValueError(f"max_probability_change must be in [0, 1], got {self.max_probability_change}")


@dataclass
class GateReport:
    """The gate's figures over the grid; ``worst`` says where each extreme happened."""

    gate: Int8Gate
    rows: int = 0
    agreeing: int = 0
    max_probability_change: float = 0.0
    max_fusion_activation_change: float = 0.0  # recorded, not gated: the adapters' weights per token
    worst: dict[str, str] = field(default_factory=dict)
    cases: int = 0

    @property
    def label_agreement(self) -> float:
        return self.agreeing / self.rows if self.rows else 1.0

    def failures(self) -> list[str]:
        bad = []
        if not self.label_agreement >= self.gate.min_label_agreement:
            bad.append(
                f"  label agreement {self.label_agreement:.2%} ({self.agreeing} of {self.rows} rows) "
                f"< {self.gate.min_label_agreement:.2%}"
            )
        if not self.max_probability_change <= self.gate.max_probability_change:
            bad.append(
                f"  max probability change {self.max_probability_change:.3g} > {self.gate.max_probability_change:g} "
                f"at {self.worst.get('probability', '?')}"
            )
        return bad

    def as_dict(self) -> dict[str, Any]:
        return {
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


def _probabilities(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Softmax of each row over its own task's ``labels`` (batch,) first columns; 0 past them (the graph pads with 0)."""
    z = np.where(np.arange(logits.shape[1]) < labels[:, None], logits.astype(np.float64), -np.inf)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


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
    wanted = {i.name for i in fp32.get_inputs()}  # type: ignore[attr-defined]
    n_labels = np.array([len(model.infos[t].labels) for t in model.task_index])  # by task index
    for what, task_id, cases in gate_runs(model, max_seq_len, wanted):
        for batch, seq, feeds in cases:
            feed = {k: v for k, v in {**feeds, "task_id": task_id}.items() if k in wanted}
            want = fp32.run(None, feed)  # type: ignore[attr-defined]
            got = int8.run(None, feed)  # type: ignore[attr-defined]
            labels = np.broadcast_to(n_labels[task_id], (batch,))  # each row's task's label count
            p_want, p_got = _probabilities(want[0], labels), _probabilities(got[0], labels)  # (batch, max_labels)
            report.rows += batch
            report.agreeing += int((p_want.argmax(-1) == p_got.argmax(-1)).sum())
            where = f"{what}, batch {batch}, sequence {seq}"
            change = float(np.abs(p_got - p_want).max()) if np.isfinite(p_got).all() else float("inf")
            if change >= report.max_probability_change:
                report.max_probability_change, report.worst["probability"] = change, where
            real = feeds["attention_mask"][:, None, :, None].astype(bool)  # (batch, 1, seq, 1)
            acts = float(np.abs((got[1] - want[1]) * real).max()) if got[1].size else 0.0
            if acts >= report.max_fusion_activation_change:
                report.max_fusion_activation_change, report.worst["fusion_activations"] = acts, where
            report.cases += 1
            if progress is not None:
                progress(1)
    bad = report.failures()
    if bad:
        raise Int8GateError(
            f"the int8 graph departs from the fp32 graph beyond the gate over {report.rows} rows "
            f"({report.cases} cases); no artifact written:\n" + "\n".join(bad)
        )
    return report
