"""What an int8 graph quantized and what it left in floating point, with why: the manifest's record of it
(``quantize.quantize_graph`` writes it, ``fusionserve inspect`` shows it)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from typing import Any

import numpy as np
import onnx

ADAPTER_NODES = "/blocks."  # name prefix of the adapter blocks' nodes in the exported graph
QUANTIZED_OPS = ("MatMul", "Attention")

# op type in the int8 graph -> why it is (still) floating point
KEPT_FP32 = {  # what stays floating point -> (what the manifest calls it, why)
    "EmbedLayerNormalization": ("embeddings", "a table lookup: nothing to gain"),
    "SkipLayerNormalization": ("LayerNorm", "no int8 form"),
    "LayerNormalization": ("LayerNorm", "no int8 form"),
    "Softmax": ("Softmax", "the fusion weights: no int8 form"),
    "Gemm": ("heads", "the classification heads run on one token per row: nothing to gain"),
    "task MatMul": (
        "MatMul without stored weights",
        "weights picked by the task index at run time (a multi-task graph's fusion matrices) or made in the graph (the "
        "0/1 matrix placing fusion weights in their output columns): only stored weights are quantized",
    ),
    "adapter MatMul": ("adapter path", "left in fp32 as asked (adapter_path=False)"),
    "backbone MatMul": (
        "backbone GEMMs",
        "left in fp32 (by default the FFN output GEMM, whose input has outliers: DEFAULT_FP32_ROLES)",
    ),
    "Attention": ("backbone attention (QKV)", "left in fp32"),
    "smooth Mul": ("smoothing Mul", "the inverse of a GEMM's smoothing scales, one per input channel (SmoothQuant)"),
}
METHOD_RECORDS = {  # Int8Options.method -> (the quantizer, how activations are quantized)
    "dynamic": ("onnxruntime.quantization.quantize_dynamic", "uint8, asymmetric, one scale per tensor computed at run time"),
    "static": (
        "onnxruntime.quantization.quantize_static (QDQ, MinMax calibration)",
        "uint8, asymmetric, one scale per tensor fixed by the calibration rows",
    ),
}


def _weights_by_type(model: onnx.ModelProto) -> Counter[str]:
    out: Counter[str] = Counter()
    for t in model.graph.initializer:
        out[onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name] += int(np.prod(t.dims))
    return out


def _activations(options: Any, rows: list[str]) -> str:
    """How the int8 graph's activations are quantized: the method's way, and per row in the GEMMs ``rows`` (names)
    rowwise.py made: the backbone's, and the adapter path's (named ADAPTER_NODES...)."""
    if not rows:
        return METHOD_RECORDS[options.method][1]
    adapters = sum(n.startswith(ADAPTER_NODES) for n in rows)
    where = f"{len(rows) - adapters} backbone GEMMs (the attention output and both feed-forward GEMMs of every layer quantized)"
    if adapters:
        where += f" and {adapters} adapter-path GEMMs (the adapters' stacked down-projections; in a one-task graph the folded fusion matrices too)"
    return (
        f"uint8, asymmetric, one scale and zero point per row (token) computed at run time in {where}; "
        + METHOD_RECORDS["dynamic"][1]
        + " in the rest"
    )


def describe(
    before: onnx.ModelProto, quantized: list[str], after: onnx.ModelProto, options: Any, rows: list[str] | None = None
) -> dict[str, Any]:
    """Operators quantized, operators left in floating point (with why), and weights by element type, for the graph
    ``before`` that was quantized (smoothed, if it was) into ``after`` with ``options`` (``quantize.Int8Options``)."""
    chosen = set(quantized)
    weights = {t.name for t in before.graph.initializer}
    kept: Counter[str] = Counter()
    for n in before.graph.node:
        kind = n.op_type
        if n.name in chosen:
            continue
        if kind == "MatMul" and len(n.input) > 1 and n.input[1] in weights:
            kind = "adapter MatMul" if n.name.startswith(ADAPTER_NODES) else "backbone MatMul"
        elif kind == "MatMul":
            kind = "task MatMul"
        elif kind == "Mul" and n.name.endswith("_smooth"):
            kind = "smooth Mul"
        if kind in KEPT_FP32:
            kept[kind] += 1
    fp32: dict[str, dict[str, Any]] = {}
    for kind, count in kept.items():
        label, why = KEPT_FP32[kind]
        if kind in ("backbone MatMul", "Attention"):
            why += f": fp32_roles {list(options.fp32_roles)}, fp32_layers {list(options.fp32_layers)}"
        if kind == "Attention" and options.method == "static":
            why = "static QDQ quantization has no int8 form of the fused Attention"
        entry = fp32.setdefault(label, {"count": 0, "why": why})
        entry["count"] += count
    ops = Counter(n.op_type for n in before.graph.node if n.name in chosen)
    return {
        "method": METHOD_RECORDS[options.method][0],
        "weights": ("int7 (reduce_range)" if options.reduce_range else "int8")
        + ", symmetric, "
        + ("one scale per output column" if options.per_channel else "one scale per tensor"),
        "activations": _activations(options, rows or []),
        "adapter_path": options.adapter_path,
        "fp32_roles": list(options.fp32_roles),
        "fp32_layers": list(options.fp32_layers),
        "options": json.loads(json.dumps(asdict(options))),  # all of them, gate included, as the manifest holds them
        "quantized": {op: ops[op] for op in QUANTIZED_OPS},
        "of": {op: sum(n.op_type == op for n in before.graph.node) for op in QUANTIZED_OPS},
        "kept_fp32": fp32,
        "weights_by_type": dict(_weights_by_type(after)),
    }
