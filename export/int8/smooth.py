"""SmoothQuant (Xiao et al., ICML 2023) for the int8 export: move the outlier channels of a GEMM's input into its weights,
exactly in fp32, before the GEMM is quantized.

For a GEMM ``X W`` (X: (tokens, C), W: (C, out)) and per-channel scales ``s`` (C,):
``X W = (X diag(s)^-1) (diag(s) W)``. With ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` (max over the calibration
rows' real tokens and over W's row j) the few input channels with outlier magnitudes shrink, so one per-tensor uint8
scale of the activation spends its range on the rest; the weights (one int8 scale per output column) take the
difference. ``diag(s) W`` is folded into the stored weight; ``diag(s)^-1`` goes where it costs least:

- the attention output projection: into the V columns (and V bias) of the fused Attention's QKV weight — the
  attention output is a convex mix of V rows per head, linear in V, so scaling V's column j scales output channel j;
  no extra operator;
- elsewhere a per-channel Mul before the GEMM. In this post-LayerNorm encoder the LayerNorm whose gamma/beta could
  take it (before QKV and the FFN's first GEMM) also feeds the residual sum, which must stay unscaled, and the FFN's
  output GEMM reads a GELU, which no scale passes through.

The smoothed fp32 graph must answer as the original does (``check_smoothed``, max |diff| <= 1e-5 on every output)
before anything is quantized.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ..model import FusionModel
from ..validate import ParityError, grid_inputs, mixed_cases
from .calibration import Calibration

SMOOTH_TOLERANCE = 1e-5  # max |smoothed fp32 - original fp32| on any output, logits and fusion activations
SCALE_BOUNDS = (1e-5, 1e5)  # s is clipped to these: a dead channel (max 0) must not divide by zero


class SmoothingError(ParityError):
    """The smoothed fp32 graph departs from the original; nothing was quantized or written."""


@dataclass(frozen=True)
class Site:
    """One GEMM to smooth: its node, the activation it reads, its stored weight and how the inverse is applied."""

    node: str
    activation: str
    weight: str
    fold_into_v: str | None  # the Attention node whose V columns take diag(s)^-1, or None: a Mul before the GEMM


def sites(graph: onnx.ModelProto, nodes: list[str]) -> list[Site]:
    """The smoothing sites of ``nodes`` (fused Attention or MatMul with a stored weight, by name)."""
    consumers = Counter(i for n in graph.graph.node for i in n.input)
    producer = {o: n for n in graph.graph.node for o in n.output}
    wanted = set(nodes)
    out = []
    for n in graph.graph.node:
        if n.name not in wanted:
            continue
        src = producer.get(n.input[0])
        fold = (
            src.name
            if src is not None
            and src.op_type == "Attention"
            and n.op_type == "MatMul"
            and consumers[n.input[0]] == 1
            and not any(a.name == "qkv_hidden_sizes" for a in src.attribute)  # V is the last third of the columns
            else None
        )
        out.append(Site(n.name, n.input[0], n.input[1], fold))
    return out


def channel_max(path: Path, tensors: list[str], calibration: Calibration) -> dict[str, np.ndarray]:
    """Per tensor of ``tensors`` (each (batch, seq, C)), the largest |value| of each channel over the calibration rows'
    real tokens (padding excluded)."""
    from fusionserve.serving.model.runtime import make_session

    graph = onnx.load(str(path))
    have = {o.name for o in graph.graph.output}
    graph.graph.output.extend(
        onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in tensors if t not in have
    )
    probe = path.with_name("calibration-probe.onnx")
    onnx.save(graph, str(probe), save_as_external_data=path.stat().st_size > 1_800_000_000)
    try:
        session = make_session(probe, device="cpu")
        wanted = {i.name for i in session.get_inputs()}
        out: dict[str, np.ndarray] = {}
        for feeds in calibration.feeds:
            values = session.run(tensors, {k: v for k, v in feeds.items() if k in wanted})
            real = feeds["attention_mask"].astype(bool)  # (batch, seq)
            for name, x in zip(tensors, values, strict=True):
                m = np.abs(x[real]).max(axis=0)  # (C,)
                out[name] = m if name not in out else np.maximum(out[name], m)
    finally:
        for f in probe.parent.glob(probe.name + "*"):
            f.unlink()
    return out


def smooth_graph(src: Path, dst: Path, nodes: list[str], alpha: float, calibration: Calibration) -> dict[str, Any]:
    """Write ``src`` with the GEMMs ``nodes`` smoothed (``alpha`` in [0, 1]) to ``dst``; returns the manifest's
    record: alpha, the calibration, the sites and how each inverse was applied, the largest scale."""
    graph = onnx.load(str(src))
    found = sites(graph, nodes)
    xmax = channel_max(src, sorted({s.activation for s in found}), calibration)
    inits = {t.name: t for t in graph.graph.initializer}
    uses = Counter(i for n in graph.graph.node for i in n.input)
    by_name = {n.name: n for n in graph.graph.node}
    new_nodes: dict[str, onnx.NodeProto] = {}  # GEMM name -> the Mul to insert before it
    largest, folded = 1.0, 0
    for site in found:
        w = numpy_helper.to_array(inits[site.weight]).astype(np.float32)  # (C, out)
        wmax = np.abs(w).max(axis=1)
        s = np.clip(np.power(xmax[site.activation], alpha) / np.power(np.maximum(wmax, 1e-12), 1 - alpha), *SCALE_BOUNDS)
        s = np.where(xmax[site.activation] > 0, s, 1.0).astype(np.float32)  # (C,)
        largest = max(largest, float(s.max()), float(1 / s.min()))
        node = by_name[site.node]
        weight = site.weight if uses[site.weight] == 1 else f"{site.weight}_smoothed_{site.node}"
        _put(graph, inits, weight, w * s[:, None])
        node.input[1] = weight
        if site.fold_into_v is not None:
            att = by_name[site.fold_into_v]
            _scale_v(graph, inits, uses, att, 1 / s)
            folded += 1
        else:
            inv = f"{site.node}_smooth_inverse"
            _put(graph, inits, inv, 1 / s)
            smoothed = f"{site.activation}_smoothed_{site.node}"
            new_nodes[site.node] = onnx.helper.make_node("Mul", [site.activation, inv], [smoothed], name=f"{site.node}_smooth")
            node.input[0] = smoothed
    ordered = []
    for n in graph.graph.node:
        if n.name in new_nodes:
            ordered.append(new_nodes[n.name])
        ordered.append(n)
    del graph.graph.node[:]
    graph.graph.node.extend(ordered)
    onnx.save(graph, str(dst), save_as_external_data=src.stat().st_size > 1_800_000_000)
    return {
        "method": "SmoothQuant: s_j = max|X_j|^alpha / max|W_j|^(1-alpha), W <- diag(s) W, X <- X diag(s)^-1",
        "alpha": alpha,
        "calibration": calibration.describe(),
        "gemms": len(found),
        "inverse_in_v_columns": folded,
        "inverse_as_mul": len(found) - folded,
        "largest_scale": round(largest, 3),
    }


def _put(graph: onnx.ModelProto, inits: dict[str, onnx.TensorProto], name: str, value: np.ndarray) -> None:
    """Set (or add) the initializer ``name`` to ``value``."""
    tensor = numpy_helper.from_array(value.astype(np.float32), name)
    if name in inits:
        inits[name].CopyFrom(tensor)
    else:
        graph.graph.initializer.append(tensor)
        inits[name] = graph.graph.initializer[-1]


def _scale_v(
    graph: onnx.ModelProto, inits: dict[str, onnx.TensorProto], uses: Counter[str], att: onnx.NodeProto, inv: np.ndarray
) -> None:
    """Scale the V columns (the last third) of the Attention ``att``'s QKV weight and bias by ``inv`` (H,)."""
    for k in (1, 2):
        name = att.input[k]
        value = numpy_helper.to_array(inits[name]).astype(np.float32).copy()  # (H, 3H) weight, (3H,) bias
        h = value.shape[-1] // 3
        value[..., 2 * h :] *= inv
        if uses[name] > 1:
            name = f"{name}_smoothed_{att.name}"
            att.input[k] = name
        _put(graph, inits, name, value)


def check_smoothed(smoothed: object, original: object, cases: list[dict[str, np.ndarray]]) -> float:
    """Max |diff| between the smoothed and the original fp32 session (onnxruntime.InferenceSession) on every output
    over ``cases``; raises SmoothingError above SMOOTH_TOLERANCE, naming each output that broke it."""
    wanted = {i.name for i in original.get_inputs()}  # type: ignore[attr-defined]
    names = [o.name for o in original.get_outputs()]  # type: ignore[attr-defined]
    worst = dict.fromkeys(names, 0.0)
    for feeds in cases:
        feed = {k: v for k, v in feeds.items() if k in wanted}
        for name, a, b in zip(names, smoothed.run(None, feed), original.run(None, feed), strict=True):  # type: ignore[attr-defined]
            if a.size:
                worst[name] = max(worst[name], float(np.abs(a - b).max()))
    bad = [f"  {name}: max |diff| {d:.3g} > {SMOOTH_TOLERANCE:g}" for name, d in worst.items() if not d <= SMOOTH_TOLERANCE]
    if bad:
        raise SmoothingError("the smoothed fp32 graph departs from the original; nothing quantized:\n" + "\n".join(bad))
    return max(worst.values())


def smooth_checked(
    src: Path,
    dst: Path,
    nodes: list[str],
    alpha: float,
    calibration: Calibration,
    fp32: object,
    model: FusionModel,
    max_seq_len: int,
) -> dict[str, Any]:
    """``smooth_graph``, then ``check_smoothed`` against the original's session ``fp32`` over the validation grid (the
    first task) and the batches mixing every task row by row; the record gets the max |diff|. Raises SmoothingError."""
    from fusionserve.serving.model.runtime import make_session

    record = smooth_graph(src, dst, nodes, alpha, calibration)
    first = np.zeros(1, dtype=np.int64)
    cases = [{**f, "task_id": first} for _, _, f in grid_inputs(model.backbone.vocab_size, max_seq_len)]
    cases += [{**f, "task_id": ids} for ids, (_, _, f) in mixed_cases(model, max_seq_len)]
    record["fp32_max_abs_diff"] = check_smoothed(getattr(fp32, "like", lambda s: s)(make_session(dst, device="cpu")), fp32, cases)
    return record
