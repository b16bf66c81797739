"""Per-row (per-token) dynamic int8 for a MatMul with a stored weight: one activation scale per row of the input,
computed at run time, where ONNX Runtime's dynamic quantization (DynamicQuantizeMatMul) has one per tensor.

A few tokens of a BERT input ([CLS], [SEP], punctuation) carry much larger values than the rest in some channels:
one scale for the whole (batch * sequence, channels) matrix is stretched by them and every other token keeps few
int8 steps. With one scale per row, only the row that holds an outlier pays for it. The rewrite, in ONNX and ONNX
Runtime's contrib operators (nothing custom), for ``Y = X W`` with X (..., K) and W (K, N):

    X2 = Reshape(X, (-1, K))                                   # (rows, K)
    hi = Max(ReduceMax(X2, axis 1), 0); lo = Min(ReduceMin(X2, axis 1), 0)   # (rows,) the row's range, 0 inside
    s  = Max((hi - lo) / 255, eps); z = Round(-lo / s)         # (rows,) asymmetric uint8 scale and zero point
    Xq = QuantizeLinear(X2, s, uint8(z), axis 0)               # (rows, K) uint8
    Y2 = MatMulIntegerToFloat(Xq, Wq, 1, w_scale)              # (rows, N) = w_scale * (Xq Wq); Wq int8, a scale a column
    Y  = Reshape(s[:, None] * Y2 - (s z)[:, None] * c, (..., N))   # c = w_scale * Wq's column sums: the zero points

ONNX Runtime's MatMulInteger kernels take one zero point for the whole of A, so each row's own zero point is
subtracted after the product, through the weight's column sums (exact in integers: (Xq - z) Wq = Xq Wq - z 1 Wq).
Asymmetric, not symmetric (one scale max|x| / 127 and zero point 128 for every row): the GELU output the FFN's
second GEMM reads is almost all positive, and on the built-in model's target texts the asymmetric form moved the
answers 20% less (mean largest probability change, benchmarks/RESULTS.md).
uint8 activations, not int8 ones: ONNX Runtime's CPU kernels for int8 x int8 ran 6x slower than its uint8 x int8
ones in a micro-benchmark here (a (2048, 1536) x (1536, 384) product: 83 ms against 14 ms).
On a CPU without VNNI (AVX2 only) ONNX Runtime's uint8 x int8 kernel sums pairs of products in 16 bits, which can
saturate for large uint8 values: such a CPU should keep the per-tensor scales (``Int8Options.activations``), as
ONNX Runtime advises 7-bit weights (reduce_range) for its dynamic quantization there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

ROW_EPS = 1e-10  # the smallest per-row scale: an all-zero row must not divide by zero
CONTRIB = "com.microsoft"


def quantize_rows(graph: onnx.ModelProto, nodes: list[str]) -> list[str]:
    """Rewrite, in place, the MatMul nodes ``nodes`` of ``graph`` (each with a stored (K, N) weight) as per-row int8
    (see the module docstring); returns the names of the MatMulIntegerToFloat nodes made. The weights get one
    symmetric int8 scale per output column. Raises ValueError for a node that is not such a MatMul."""
    inits = {t.name: t for t in graph.graph.initializer}
    wanted = set(nodes)
    made: list[str] = []
    ordered: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    shared = _shared_constants(added)
    for n in graph.graph.node:
        if n.name not in wanted:
            ordered.append(n)
            continue
        if n.op_type != "MatMul" or len(n.input) != 2 or n.input[1] not in inits:
            raise ValueError(f"{n.name}: per-row int8 takes a MatMul with a stored weight, got {n.op_type}")
        w = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)  # (K, N)
        if w.ndim != 2:
            raise ValueError(f"{n.name}: per-row int8 takes a 2-D weight, got shape {w.shape}")
        ordered += _rewrite(n, w, added, shared)
        made.append(f"{n.name}_int8")
    if len(made) != len(wanted):
        missing = sorted(wanted - {m.removesuffix("_int8") for m in made})
        raise ValueError(f"per-row int8: no node named {missing[0]}")
    del graph.graph.node[:]
    graph.graph.node.extend(ordered)
    graph.graph.initializer.extend(added)
    if not any(o.domain == CONTRIB for o in graph.opset_import):
        graph.opset_import.append(oh.make_opsetid(CONTRIB, 1))
    return made


def weight_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 weight, float32 scale per column) of ``w`` (K, N): symmetric, scale max|column| / 127."""
    scale = np.abs(w).max(axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)  # (N,)
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


def _shared_constants(added: list[onnx.TensorProto]) -> dict[str, str]:
    """Scalars and shapes every rewritten node reads, added once."""
    values = {
        "inv255": np.array(1 / 255, np.float32),
        "eps": np.array(ROW_EPS, np.float32),
        "zero": np.array(0.0, np.float32),
        "one": np.array(1.0, np.float32),
        "axis1": np.array([1], np.int64),
        "first": np.array([0], np.int64),
        "last": np.array([-1], np.int64),
    }
    names = {}
    for key, value in values.items():
        names[key] = f"rowwise_int8_{key}"
        added.append(numpy_helper.from_array(value, names[key]))
    return names


def _rewrite(n: onnx.NodeProto, w: np.ndarray, added: list[onnx.TensorProto], c: dict[str, str]) -> list[onnx.NodeProto]:
    """The nodes computing ``n``'s output per-row int8 (module docstring); their constants go to ``added``."""
    p, x, y = n.name, n.input[0], n.output[0]
    k, cols = w.shape
    wq, ws = weight_int8(w)
    colsum = (wq.astype(np.float32).sum(axis=0) * ws).astype(np.float32)  # (N,)
    for name, value in (
        (f"{p}_wq", wq),
        (f"{p}_wscale", ws),
        (f"{p}_colsum", colsum),
        (f"{p}_rows_k", np.array([-1, k], np.int64)),
    ):
        added.append(numpy_helper.from_array(value, name))
    added.append(numpy_helper.from_array(np.array([cols], np.int64), f"{p}_n"))

    def node(op: str, inputs: list[str], out: str, **kw: object) -> onnx.NodeProto:
        return oh.make_node(op, inputs, [out if out == y else f"{p}_{out}"], name=f"{p}_{out}" if out != y else p, **kw)

    t = f"{p}_"
    return [
        node("Shape", [x], "shape"),
        node("Reshape", [x, f"{p}_rows_k"], "rows"),  # (rows, K)
        node("ReduceMax", [t + "rows"], "max", axes=[1], keepdims=0),  # (rows,)
        node("ReduceMin", [t + "rows"], "min", axes=[1], keepdims=0),
        node("Max", [t + "max", c["zero"]], "hi"),  # the range holds 0, so that 0 is exact
        node("Min", [t + "min", c["zero"]], "lo"),
        node("Sub", [t + "hi", t + "lo"], "range"),
        node("Mul", [t + "range", c["inv255"]], "scale0"),
        node("Max", [t + "scale0", c["eps"]], "scale"),
        node("Div", [t + "lo", t + "scale"], "lo_steps"),
        node("Neg", [t + "lo_steps"], "zp_neg"),
        node("Round", [t + "zp_neg"], "zp_float"),  # (rows,) in 0..255
        node("Cast", [t + "zp_float"], "zp", to=TensorProto.UINT8),
        node("QuantizeLinear", [t + "rows", t + "scale", t + "zp"], "q", axis=0),  # (rows, K) uint8
        oh.make_node(
            "MatMulIntegerToFloat", [t + "q", f"{p}_wq", c["one"], f"{p}_wscale"], [t + "y_q"], name=f"{p}_int8", domain=CONTRIB
        ),  # (rows, N): w_scale * (Xq Wq)
        node("Unsqueeze", [t + "scale", c["axis1"]], "row_scale"),  # (rows, 1)
        node("Mul", [t + "y_q", t + "row_scale"], "y_scaled"),
        node("Mul", [t + "scale", t + "zp_float"], "zp_scaled"),  # (rows,)
        node("Unsqueeze", [t + "zp_scaled", c["axis1"]], "row_zp"),  # (rows, 1)
        node("Mul", [t + "row_zp", f"{p}_colsum"], "zp_term"),  # (rows, N)
        node("Sub", [t + "y_scaled", t + "zp_term"], "y_rows"),
        node("Slice", [t + "shape", c["first"], c["last"]], "lead"),
        node("Concat", [t + "lead", f"{p}_n"], "out_shape", axis=0),
        node("Reshape", [t + "y_rows", t + "out_shape"], y),  # (..., N)
    ]
