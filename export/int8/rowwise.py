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
    Xz = Concat(Xq, z repeated J times, axis 1)                # (rows, K + J) uint8
    Y  = Reshape(MatMulIntegerToFloat(Xz, [Wq; D], s[:, None], w_scale), (..., N))

Wq is the int8 weight (K, N), one scale a column. ONNX Runtime's integer GEMMs take one zero point for the whole of
A, so each row's own is subtracted inside the product instead: D (J, N) holds int8 rows whose column sums are minus
Wq's, so Xz [Wq; D] = Xq Wq - z (1 Wq) = (Xq - z) Wq, exact in integers, and the row scale is the GEMM's own A scale
(MatMulIntegerToFloat takes it per row as a (rows, 1) tensor). J is the largest column sum / 127, a small fraction
of K in MiniLM's and BERT-base's GEMMs (the counts: commit 6733b24), and no pass over the (rows, N) output is added:
the first form, which subtracted ``z * column sums`` after the product and scaled the rows with Mul, spent a
noticeable share of MiniLM's batch-16 time in them (commit 6733b24). Speed: benchmarks/RESULTS.md, "Latency: int8
variants against fp32 (in-process, issue 28)".
Asymmetric, not symmetric (one scale max|x| / 127 and zero point 128 for every row): the GELU output the FFN's
second GEMM reads is almost all positive, and on the built-in model's target texts the asymmetric form moved the
answers less (mean largest probability change: RESULTS.md, "int8 in every GEMM: smoothing and static QDQ (issue 28)",
"Selection on dev + train texts").
uint8 activations, not int8 ones: ONNX Runtime's CPU kernels for int8 x int8 ran several times slower than its
uint8 x int8 ones in a micro-benchmark (commit 91672cb).
On a CPU without VNNI (AVX2 only) ONNX Runtime's uint8 x int8 kernel sums pairs of products in 16 bits, which can
saturate for large uint8 values: such a CPU should keep the per-tensor scales (``Int8Options.activations``), as
ONNX Runtime advises 7-bit weights (reduce_range) for its dynamic quantization there.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from fusionserve.serving.private import ROW_SCALE_GEMM

ROW_EPS = 1e-10  # the smallest per-row scale: an all-zero row must not divide by zero
MIN_OPSET = 13  # QuantizeLinear takes one scale per row (its axis) from opset 13 on
CONTRIB, ROW_SCALE_OP = ROW_SCALE_GEMM  # ONNX Runtime's contrib operator, A scale per row (serving/private.py)


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
    opset = next((o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise ValueError(f"per-row int8 needs opset {MIN_OPSET} or later (QuantizeLinear per axis); the graph has {opset}")
    for n in graph.graph.node:
        if n.name not in wanted:
            ordered.append(n)
            continue
        if n.op_type != "MatMul" or len(n.input) != 2 or n.input[1] not in inits:
            raise ValueError(f"{n.name}: per-row int8 takes a MatMul with a stored weight, got {n.op_type}")
        w = numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)  # (K, N)
        if w.ndim != 2:
            raise ValueError(f"{n.name}: per-row int8 takes a 2-D weight, got shape {w.shape}")
        ordered += _rewrite(n, w, added, shared, axes_as_input=opset >= 18)
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


def zero_point_rows(wq: np.ndarray) -> np.ndarray:
    """(J, N) int8 rows whose column sums are minus ``wq``'s (K, N) column sums, J as few as int8 allows: appended to
    the weight, with the input's row zero point in J appended columns, they subtract ``z * column sum`` in the GEMM."""
    target = -wq.astype(np.int64).sum(axis=0)  # (N,)
    rows = max(1, int(np.ceil(np.abs(target).max() / 127)))
    out = np.zeros((rows, wq.shape[1]), dtype=np.int64)
    for j in range(rows):
        out[j] = np.clip(target, -127, 127)
        target = target - out[j]
    return out.astype(np.int8)


def _rewrite(
    n: onnx.NodeProto, w: np.ndarray, added: list[onnx.TensorProto], c: dict[str, str], axes_as_input: bool
) -> list[onnx.NodeProto]:
    """The nodes computing ``n``'s output per-row int8 (module docstring); their constants go to ``added``. From opset
    18 on, ReduceMax / ReduceMin take their axes as an input (``axes_as_input``), before as an attribute."""
    p, x, y = n.name, n.input[0], n.output[0]
    k, cols = w.shape
    wq, ws = weight_int8(w)
    extra = zero_point_rows(wq)  # (J, N)
    for name, value in (
        (f"{p}_wq", np.concatenate([wq, extra])),  # (K + J, N)
        (f"{p}_wscale", ws),
        (f"{p}_zp_width", np.array([1, len(extra)], np.int64)),
        (f"{p}_rows_k", np.array([-1, k], np.int64)),
        (f"{p}_n", np.array([cols], np.int64)),
    ):
        added.append(numpy_helper.from_array(value, name))

    def node(op: str, inputs: list[str], out: str, **kw: object) -> onnx.NodeProto:
        return oh.make_node(op, inputs, [out if out == y else f"{p}_{out}"], name=f"{p}_{out}" if out != y else p, **kw)

    t = f"{p}_"

    def reduce(op: str, out: str) -> onnx.NodeProto:
        if axes_as_input:
            return node(op, [t + "rows", c["axis1"]], out, keepdims=0)
        return node(op, [t + "rows"], out, axes=[1], keepdims=0)

    return [
        node("Shape", [x], "shape"),
        node("Reshape", [x, f"{p}_rows_k"], "rows"),  # (rows, K)
        reduce("ReduceMax", "max"),  # (rows,)
        reduce("ReduceMin", "min"),
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
        node("Unsqueeze", [t + "zp", c["axis1"]], "zp_col"),  # (rows, 1)
        node("Expand", [t + "zp_col", f"{p}_zp_width"], "zp_cols"),  # (rows, J)
        node("Concat", [t + "q", t + "zp_cols"], "q_zp", axis=1),  # (rows, K + J) uint8
        node("Unsqueeze", [t + "scale", c["axis1"]], "row_scale"),  # (rows, 1)
        oh.make_node(
            ROW_SCALE_OP,
            [t + "q_zp", f"{p}_wq", t + "row_scale", f"{p}_wscale"],
            [t + "y_rows"],
            name=f"{p}_int8",
            domain=CONTRIB,
        ),  # (rows, N) = row_scale * w_scale * ((Xq - z) Wq), exact in integers
        node("Slice", [t + "shape", c["first"], c["last"]], "lead"),
        node("Concat", [t + "lead", f"{p}_n"], "out_shape", axis=0),
        node("Reshape", [t + "y_rows", t + "out_shape"], y),  # (..., N)
    ]
