"""bf16 for CPUs with bf16 matrix units: the validated fp32 standard-op graph, compiled by OpenVINO's CPU plugin with
bf16 as its inference precision (serving/model/openvino_runtime.py), and the gate it must pass against the fp32 graph
before it may become an artifact.

Why OpenVINO and this graph (docs/guides/int8.md, "bf16"): ONNX Runtime's CPU provider has no bf16 GEMM kernels on
x86, while OpenVINO's CPU plugin runs bf16 on AMX and AVX-512 BF16 through oneDNN; it reads the graph as the exporter
traced it (standard ONNX operators; ONNX Runtime's fused contrib operators it cannot read) and fuses it itself. So the
bf16 artifact's ``model.onnx`` is that graph in fp32: ONNX Runtime runs it too (the parity check at export, the gates of
``tasks add``), and the rounding to bf16 happens when OpenVINO compiles it.

The gate: bf16 keeps 8 significant bits, so every logit moves a little and the fp32 parity tolerance (1e-4) cannot
hold. ``check_bf16`` runs both graphs over the export's validation grid for every task and over the batches mixing every
task row by row, and asks for label agreement and a largest logit change (``Bf16Gate``); every figure that breaks its
threshold is collected into one error, and no artifact is written. On a CPU without bf16 units OpenVINO emulates bf16
with AVX-512 (the same rounding), so the gate measures bf16's answers there too; where it cannot (no AVX-512: the
compiled model says f32), the export is refused: its figures would be fp32's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.serving.model.cpu_flags import cpu_bf16_units
from fusionserve.serving.model.openvino_runtime import compile_graph, device_capabilities, no_bf16_here, openvino_version

from .int8.gate import compare_grid
from .model import FusionModel
from .validate import BATCH_SIZES, SEQ_LENS, ParityError


class Bf16GateError(ParityError):
    """The bf16 graph departs from the fp32 graph beyond the gate, or cannot be checked on this CPU; no artifact."""


@dataclass(frozen=True)
class Bf16Gate:
    """What the bf16 graph must keep of the fp32 graph's answers over the validation grid (every task, every row).

    The grid's random token ids make ambiguous inputs (top two labels close), where a flip costs a row. Measured with
    OpenVINO 2026.4's bf16 (oneDNN's AVX-512 emulation on a Xeon without bf16 units: the same rounding): the built-in
    model's 11-task graph over the grid and its mixed batches kept 99.65% of 286 rows' labels, largest logit change
    0.058; the tests' tiny model 100% / 0.049. The thresholds leave 4x that logit change and a few flips on random
    inputs; the built-in model's targets' whole test splits are in docs/guides/int8.md."""

    min_label_agreement: float = 0.97  # share of rows whose label equals the fp32 graph's
    max_logit_change: float = 0.25  # largest |logit_bf16 - logit_fp32| over each row's own task's labels

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_label_agreement <= 1.0:
            raise ValueError(f"min_label_agreement must be in [0, 1], got {self.min_label_agreement}")
        if not self.max_logit_change >= 0.0:
            raise ValueError(f"max_logit_change must be >= 0, got {self.max_logit_change}")


@dataclass
class Bf16Report:
    """The gate's figures; ``worst`` says where each extreme happened."""

    gate: Bf16Gate
    rows: int = 0
    agreeing: int = 0
    max_logit_change: float = 0.0
    max_fusion_activation_change: float = 0.0  # recorded, not gated
    cases: int = 0
    worst: dict[str, str] = field(default_factory=dict)

    @property
    def label_agreement(self) -> float:
        return self.agreeing / self.rows if self.rows else 1.0

    def add(self, head: str, want: np.ndarray, got: np.ndarray, real: np.ndarray, where: str) -> None:
        """One task's rows of a case: ``got`` / ``want`` its own output columns, (rows, labels) for a sequence-level head,
        (rows, seq, labels) for a token-level one, whose real tokens ``real`` (rows, seq) marks. What agrees is what a
        caller reads: a sequence-level row's label (a one-column head, regression or a multiple-choice pair's score, has
        no label: its value change alone is gated); a tagging row's label of each real token; a QA row's start and its
        end token (the argmax over its real tokens of each column)."""
        got, want = got.astype(np.float64), want.astype(np.float64)
        if got.ndim == 3:
            if head == "question_answering":  # (rows, seq, 2) -> the chosen token of each column
                masked = [np.where(real[..., None], x, -np.inf).argmax(axis=1) for x in (got, want)]
                self.rows += masked[0].size
                self.agreeing += int((masked[0] == masked[1]).sum())
            else:  # tagging: each real token's label
                self.rows += int(real.sum())
                self.agreeing += int((got[real].argmax(-1) == want[real].argmax(-1)).sum())
            diff = np.abs(got - want)[np.broadcast_to(real[..., None], got.shape)]
        else:
            self.rows += len(got)
            self.agreeing += int((got.argmax(-1) == want.argmax(-1)).sum()) if got.shape[1] > 1 else len(got)
            diff = np.abs(got - want)
        change = float(diff.max()) if diff.size else 0.0
        change = change if np.isfinite(change) else float("inf")
        if change >= self.max_logit_change:
            self.max_logit_change, self.worst["logits"] = change, where

    def failures(self) -> list[str]:
        bad = []
        if not self.label_agreement >= self.gate.min_label_agreement:
            bad.append(
                f"  label agreement {self.label_agreement:.2%} ({self.agreeing} of {self.rows} rows) "
                f"< {self.gate.min_label_agreement:.2%}"
            )
        if not self.max_logit_change <= self.gate.max_logit_change:
            bad.append(
                f"  max logit change {self.max_logit_change:.3g} > {self.gate.max_logit_change:g} at {self.worst.get('logits', '?')}"
            )
        return bad

    def as_dict(self) -> dict[str, Any]:
        return {
            "thresholds": asdict(self.gate),
            "label_agreement": self.label_agreement,
            "rows": self.rows,
            "max_logit_change": self.max_logit_change,
            "max_fusion_activation_change": self.max_fusion_activation_change,
            "worst_case": self.worst,
            "cases": self.cases,
            "grid": {"batch_sizes": list(BATCH_SIZES), "sequence_lengths": list(SEQ_LENS), "padded": True},
            "reference": "the fp32 graph (ONNX Runtime) this one is compiled from (see 'parity')",
        }


def check_bf16(
    bf16: Any, fp32: Any, model: FusionModel, max_seq_len: int, gate: Bf16Gate, progress: Callable[[int], None] | None = None
) -> Bf16Report:
    """Compare the bf16 session with the fp32 session for every task over the validation grid and over batches mixing
    every task (``int8.gate.compare_grid``, the int8 gate's cases). Raises Bf16GateError listing every figure that
    breaks ``gate``."""
    report = Bf16Report(gate)
    compare_grid(bf16, fp32, model, max_seq_len, report, progress)
    bad = report.failures()
    if bad:
        raise Bf16GateError(
            f"the bf16 graph departs from the fp32 graph beyond the gate over {report.rows} rows "
            f"({report.cases} cases); no artifact written:\n" + "\n".join(bad)
        )
    return report


def bf16_graph(
    graph: Path, fp32: Any, model: FusionModel, max_seq_len: int, gate: Bf16Gate, progress: Callable[[int], None] | None = None
) -> tuple[Any, dict[str, Any]]:
    """Compile ``graph`` (the validated fp32 standard-op graph, whose ONNX Runtime session is ``fp32``) in bf16 and
    gate it; (bf16 session, the manifest's 'bf16' record: the gate's figures and what ran them). Raises Bf16GateError
    when it fails the gate, or when this CPU runs it in fp32 (nothing to check); MissingDependency without OpenVINO."""
    session = compile_graph(graph, "bf16", cache=False)
    units = cpu_bf16_units()
    if session.inference_precision != "bf16":  # (export_artifact refused it before the export already)
        raise Bf16GateError(no_bf16_here(graph.name, session.inference_precision))
    checked = getattr(fp32, "like", lambda s: s)(session)  # a live graph: fed its tables too
    report = check_bf16(checked, fp32, model, max_seq_len, gate, progress)
    runtime = {
        "name": "openvino",
        "version": openvino_version(),
        "inference_precision": session.inference_precision,
        "cpu_bf16_units": units,
        "emulated": not units,  # no bf16 units: oneDNN rounds to bf16 and multiplies in fp32 (AVX-512)
        "optimization_capabilities": device_capabilities(),
    }
    return checked, {"gate": report.as_dict(), "runtime": runtime}
