"""Parity at export: ONNX Runtime against the PyTorch model over a grid of batch sizes and padded sequence
lengths, for every task. Every failing output is collected, then one error lists the max diff of each."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fusionserve.errors import FusionServeError

from .grid import BATCH_SIZES, SEQ_LENS, grid_inputs
from .model import FusionModel

# Max abs diff allowed, per precision and output (activations: over real tokens, padding excluded). fp16 keeps
# ~3 significant digits: a 5e-2 logit error moves probabilities by about 1%. The fusion softmax itself runs in
# fp32, but its input comes out of the fp16 backbone and a sharp fusion (large scores) magnifies that rounding
# into single weights (0.2 seen on a random tiny model): for fp16 the activations' diff is recorded, not gated.
# token_logits (tagging, question answering) are gated as logits are, over each row's real tokens.
TOLERANCES: dict[str, dict[str, float | None]] = {
    "fp32": {"logits": 1e-4, "fusion_activations": 1e-4, "token_logits": 1e-4},
    "fp16": {"logits": 5e-2, "fusion_activations": None, "token_logits": 5e-2},
}
GRIDS = ("full", "quick")
# quick: the whole grid for one task of each kind (fusion, adapter, head) and head level (sequence, token), one padded
# case for every other task; every task's folded weights still run, and each kind's code path sees every shape
QUICK_CASE = (3, 37)


class ParityError(FusionServeError):
    """ONNX Runtime and PyTorch disagree beyond the tolerance; no artifact was written."""


@dataclass
class ParityReport:
    precision: str
    tolerance: dict[str, float | None]  # None: recorded, not gated
    max_abs_diff: dict[str, float] = field(default_factory=dict)  # output -> worst over everything
    worst: dict[str, str] = field(default_factory=dict)  # output -> where it happened
    cases: int = 0
    grid: str = "full"

    def as_dict(self) -> dict[str, object]:
        return {
            "precision": self.precision,
            "tolerance": self.tolerance,
            "max_abs_diff": self.max_abs_diff,
            "worst_case": self.worst,
            "cases": self.cases,
            "grid": {"kind": self.grid, "batch_sizes": list(BATCH_SIZES), "sequence_lengths": list(SEQ_LENS), "padded": True},
            "reference": "fusionserve PyTorch model (fp32), itself checked against AdapterHub in the test suite",
        }


class Remembered:
    """A session (onnxruntime.InferenceSession, or serving's WithTables) that runs each distinct feed once and answers
    it again from memory: the int8 and bf16 exports run their fp32 graph over the same grid in the parity check, the
    smoothing check and the gate. A graph answers the same feed with the same bytes, so what is remembered is what a
    run would return; the arrays are read-only. Everything else (inputs, outputs, a live graph's tables) is the
    session's."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self._names = [o.name for o in session.get_outputs()]
        self._answers: dict[tuple[Any, ...], dict[str, np.ndarray]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def run(self, names: list[str] | None, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        key = tuple((k, v.dtype.str, v.shape, v.tobytes()) for k, v in sorted(feed.items()))
        if key not in self._answers:
            answers = self.session.run(self._names, dict(feed))
            for a in answers:
                a.flags.writeable = False
            self._answers[key] = dict(zip(self._names, answers, strict=True))
        got = self._answers[key]
        return [got[n] for n in (self._names if names is None else names)]


def tolerances(precision: str, outputs: tuple[str, ...]) -> dict[str, float | None]:
    """The tolerance of each of a graph's ``outputs`` at ``precision`` (token_logits only where the graph has them)."""
    return {k: v for k, v in TOLERANCES[precision].items() if k in outputs}


def answer_masks(model: FusionModel, task_id: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
    """Per output, where a row's answer is (True) for rows of tasks ``task_id`` ((1,) or (batch,)): a sequence-level
    row's first len(labels) logits; a token-level row's first len(labels) token logits over its real tokens; every
    row's fusion activations over its real tokens. Each mask broadcasts to its output's shape."""
    batch = attention_mask.shape[0]
    rows = np.broadcast_to(task_id, (batch,))
    infos = list(model.infos.values())  # task-index order
    labels = np.array([len(info.labels) for info in infos])[rows][:, None]  # (batch, 1)
    token = np.array([info.level == "token" for info in infos])[rows][:, None]  # (batch, 1)
    real = attention_mask.astype(bool)  # (batch, seq)
    masks = {
        "logits": ~token & (np.arange(model.max_labels)[None, :] < labels),  # (batch, max_labels)
        "fusion_activations": real[:, None, :, None],  # (batch, 1, seq, 1)
    }
    if model.levels["token"]:  # (batch, seq, token_width)
        masks["token_logits"] = (token & real)[:, :, None] & (np.arange(model.token_width)[None, None, :] < labels[:, :, None])
    return masks


def max_diff(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> float:
    """max |got - want| where ``mask`` (0 where it selects nothing; inf for a non-finite difference)."""
    diff = np.abs(got.astype(np.float64) - want)[np.broadcast_to(mask, got.shape)]
    worst = float(diff.max()) if diff.size else 0.0
    return worst if np.isfinite(worst) else float("inf")


def _plan(model: FusionModel, max_seq_len: int, grid: str) -> list[tuple[str, list[tuple[int, int, dict[str, np.ndarray]]]]]:
    """(task, its cases) for ``grid``; raises FusionServeError for an unknown grid."""
    if grid not in GRIDS:
        raise FusionServeError(f"--parity-grid must be one of {', '.join(GRIDS)}, got '{grid}'")
    cases = grid_inputs(model.backbone.vocab_size, max_seq_len)
    if grid == "full":
        return [(task, cases) for task in model.task_index]
    first_of_kind: dict[tuple[str, str], str] = {}
    for task, info in model.infos.items():
        first_of_kind.setdefault((info.kind, info.level), task)
    batch, seq = QUICK_CASE[0], min(QUICK_CASE[1], max_seq_len)
    one = [c for c in cases if c[0] == batch and c[1] == seq] or cases[:1]
    return [(task, cases if task in first_of_kind.values() else one) for task in model.task_index]


def check_parity(
    session: object,
    model: FusionModel,
    precision: str,
    max_seq_len: int,
    progress: Callable[[int], None] | None = None,
    grid: str = "full",
) -> ParityReport:
    """Compare ``session`` (an onnxruntime.InferenceSession) with ``model`` for every task over ``grid``.

    Raises ParityError listing each output's max diff when any exceeds the tolerance for ``precision``."""
    tol = tolerances(precision, model.outputs)
    report = ParityReport(precision, tol, {k: 0.0 for k in tol}, grid=grid)
    # a graph with one task and no adapter never reads task_id, and the exporter drops unused inputs
    wanted = {i.name for i in session.get_inputs()}  # type: ignore[attr-defined]
    runs = [(f"task {t}", np.array([model.task_index[t]]), c) for t, c in _plan(model, max_seq_len, grid)]
    if "task_id" in wanted:  # rows of every task in one batch: each row gets its own task's answer
        runs += [(f"tasks {ids.tolist()}", ids, [c]) for ids, c in mixed_cases(model, max_seq_len)]
    for what, task_id, cases in runs:
        for batch, seq, feeds in cases:
            feed = {k: v for k, v in {**feeds, "task_id": task_id}.items() if k in wanted}
            got = dict(zip(model.outputs, session.run(list(model.outputs), feed), strict=True))  # type: ignore[attr-defined]
            with torch.inference_mode():
                want = model(
                    *(torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask", "token_type_ids")),
                    torch.from_numpy(task_id),
                )
            masks = answer_masks(model, task_id, feeds["attention_mask"])
            for name, want_out in zip(model.outputs, want, strict=True):
                diff = max_diff(got[name], want_out.numpy(), masks[name])
                if diff >= report.max_abs_diff[name]:
                    report.max_abs_diff[name] = diff
                    report.worst[name] = f"{what}, batch {batch}, sequence {seq}"
            report.cases += 1
            if progress is not None:
                progress(1)
    bad = [k for k, v in report.max_abs_diff.items() if (limit := tol[k]) is not None and not v <= limit]
    if bad:
        lines = [
            f"  {k}: max |diff| {report.max_abs_diff[k]:.3g} (tolerance {'none' if tol[k] is None else format(tol[k], 'g')}) at {report.worst[k]}"
            for k in tol
        ]
        raise ParityError(f"ONNX Runtime disagrees with PyTorch ({precision}); no artifact written:\n" + "\n".join(lines))
    return report


def mixed_cases(model: FusionModel, max_seq_len: int) -> list[tuple[np.ndarray, tuple[int, int, dict[str, np.ndarray]]]]:
    """Batches whose rows cycle through every task (a task id per row), at each sequence length; none for a graph
    with one task."""
    tasks = len(model.task_index)
    if tasks < 2:
        return []
    batch = max(BATCH_SIZES[-1], tasks)
    cases = grid_inputs(model.backbone.vocab_size, max_seq_len, seed=1, batch_sizes=(batch,))
    return [(np.arange(batch, dtype=np.int64) % tasks, case) for case in cases]


def count_cases(model: FusionModel, max_seq_len: int, grid: str = "full") -> int:
    """Cases ``check_parity`` runs over ``grid`` (and ``quantize.check_int8``, over the full grid), mixed batches included."""
    return sum(len(cases) for _, cases in _plan(model, max_seq_len, grid)) + len(mixed_cases(model, max_seq_len))
