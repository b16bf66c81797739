"""int8 for CPU: dynamic quantization of the validated fp32 graph (ONNX Runtime's, and per-row GEMMs of its own in
``rowwise.py``), and the gate (``int8_gate.py``) the int8 graph must pass against it before it may become an artifact.

What is quantized: every MatMul with a constant weight — the backbone's attention output and both feed-forward GEMMs,
the adapters' stacked down-projection and, in a graph whose fusion weights are constants (one task), the folded fusion
matrices — and the fused Attention's QKV projection (QAttention). Weights are int8 with one scale per output column
(per-channel); activations uint8 computed at run time, with one scale and zero point per row (token) in the backbone's
attention output and FFN GEMMs (``Int8Options.activations``, ``gemm_roles.ROW_ROLES``) and one per tensor in the rest.
Why per-channel weight scales, 8-bit weights and the adapter path in int8: per-tensor weight scales fall below the
gate over the export grid, and 7-bit weights (reduce_range) or an fp32 adapter path do no better (benchmarks/int8.py;
benchmarks/RESULTS.md, "int8 accuracy (default model)"). Why per-row activations: RESULTS.md, "int8 in every GEMM:
smoothing and static QDQ (issue 28)".
What stays fp32: the embeddings (a table lookup), every LayerNormalization and Softmax (the fusion weights among them:
dynamic quantization has no int8 form of either), the MatMuls whose weights a task index selects at run time (a
multi-task graph's fusion matrices: only constant weights can be quantized ahead of time), the classification
heads (Gemm on one token per row), and the backbone GEMMs ``Int8Options.fp32_roles`` names (none by default).

The gate cannot be parity to 1e-4: int8 moves every logit. It checks what a caller sees, against the fp32 graph
the int8 one was made from (itself within 1e-4 of PyTorch), over the export's validation grid for every task and
its batches mixing every task row by row (QKV's and the adapters' activation scales are per batch, so a row's answer
depends on its batch): the share of rows whose label is unchanged, and the largest change of any label's
probability. Every figure that breaks its threshold is collected, then one error lists them all and no artifact is
written.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from ..model import FusionModel
from ..onnx_export import ExportError
from .calibration import Calibration, FeedReader, calibration_inputs, with_types
from .describe import ADAPTER_NODES, KEPT_FP32, QUANTIZED_OPS, describe
from .gate import GateReport, Int8Gate, Int8GateError, check_int8
from .gemm_roles import (
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    DEFAULT_ADAPTER_ROWS,
    DEFAULT_FP32_ROLES,
    DEFAULT_METHOD,
    DEFAULT_SMOOTH_ALPHA,
    DEFAULT_SMOOTH_ROLES,
    METHODS,
    ROLES,
    ROW_ROLES,
)

# re-exported: their homes are int8_describe and int8_gate
__all__ = ["KEPT_FP32", "GateReport", "Int8Gate", "Int8GateError", "check_int8", "describe"]


@dataclass(frozen=True)
class Int8Options:
    """How the fp32 graph is quantized and the gate it must pass. The defaults are what the measurements chose;
    the others are there to measure the choice again (benchmarks/int8.py)."""

    per_channel: bool = True  # weights: one scale per output column (False: one per tensor)
    adapter_path: bool = True  # quantize the adapters' and fusions' constant-weight MatMuls too
    # weights in 7 bits: ONNX Runtime's advice for CPUs without VNNI, whose u8 x s8 products can saturate
    reduce_range: bool = False
    # backbone nodes left in fp32: a role of ROLES in every layer, or "role:layer" in one layer (0 the first, -1 the last)
    fp32_roles: tuple[str, ...] = DEFAULT_FP32_ROLES
    fp32_layers: tuple[int, ...] = ()  # backbone layers left wholly in fp32 (0 the first, -1 the last)
    gate: Int8Gate = field(default_factory=Int8Gate)
    # "dynamic": activation scales computed per batch at run time; "static": QDQ, scales fixed by the calibration rows
    method: str = DEFAULT_METHOD
    # SmoothQuant (smooth.py): alpha in [0, 1], or None for no smoothing; applied to the quantized backbone GEMMs of
    # smooth_roles, with scales from the calibration rows (a JSONL file of texts, or None: the validation grid)
    smooth_alpha: float | None = DEFAULT_SMOOTH_ALPHA
    smooth_roles: tuple[str, ...] = DEFAULT_SMOOTH_ROLES
    calibration: str | None = None
    # dynamic only: "row", one activation scale per row (token) for the backbone GEMMs of ROW_ROLES (rowwise.py), or
    # "tensor", one per tensor as ONNX Runtime's quantizer makes them everywhere else
    activations: str = DEFAULT_ACTIVATIONS
    # with activations "row": the adapter path's constant-weight MatMuls per row too (False: one scale per tensor, the
    # form before issue 38)
    adapter_rows: bool = DEFAULT_ADAPTER_ROWS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: unknown '{self.method}'; allowed: {', '.join(METHODS)}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations: unknown '{self.activations}'; allowed: {', '.join(ACTIVATIONS)}")
        if self.smooth_alpha is not None and not 0.0 <= self.smooth_alpha <= 1.0:
            raise ValueError(f"smooth_alpha must be in [0, 1] (or None: no smoothing), got {self.smooth_alpha}")
        if unknown := [r for r in self.smooth_roles if r not in ROLES]:
            raise ValueError(f"smooth_roles: unknown role '{unknown[0]}'; allowed: {', '.join(ROLES)}")
        for entry in self.fp32_roles:
            role, _, layer = entry.partition(":")
            if role not in ROLES or (layer and not layer.lstrip("-").isdigit()):
                raise ValueError(f"fp32_roles: unknown entry '{entry}'; allowed: {', '.join(ROLES)}, each optionally ':<layer>'")


DEFAULT_OPTIONS = Int8Options()


def quantize_graph(
    src: Path,
    dst: Path,
    options: Int8Options = DEFAULT_OPTIONS,
    backbone: tuple[str, int] | None = None,
    calibration: Calibration | None = None,
) -> dict[str, Any]:
    """Quantize the optimized fp32 graph ``src`` into ``dst`` (``options.method``, see the module docstring) and return
    what was quantized and what stayed floating point, for the manifest. ``backbone``: (architecture, layers), to
    check that every layer's GEMMs were found where ``options`` leaves some in fp32 (see ``check_roles``);
    ``calibration``: the rows static quantization takes its activation ranges from (required for it)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    before = onnx.load(str(src), load_external_data=False)
    if backbone is not None and (options.fp32_roles or options.fp32_layers or _row_nodes_wanted(options)):
        check_roles(backbone_roles(before), *backbone)
    nodes = quantizable(before, options)
    if options.method == "static":  # ONNX Runtime's QDQ quantizer has no int8 Attention
        nodes = [n.name for n in before.graph.node if n.name in set(nodes) and n.op_type == "MatMul"]
    if not nodes:  # an empty list would mean "every node" to the quantizer
        raise ExportError(f"{src}: no MatMul with a constant weight and no Attention to quantize")
    common: dict[str, Any] = {
        "nodes_to_quantize": nodes,  # by name: the quantizer would also turn the heads' Gemms into MatMuls
        "per_channel": options.per_channel,
        "reduce_range": options.reduce_range,
        "weight_type": QuantType.QInt8,
        # the contrib operators of the optimized graph (Attention, SkipLayerNormalization, ...) have no ONNX shape
        # inference: their outputs are float32, which is what this says
        "extra_options": {"DefaultTensorType": onnx.TensorProto.FLOAT, "MatMulConstBOnly": True},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the quantizer advises shape-inference pre-processing: ORT's optimizer did it
        try:
            if options.method == "static":
                if calibration is None:
                    raise ValueError("static quantization needs calibration rows")
                wanted = {i.name for i in before.graph.input}
                reader = FeedReader([{k: v for k, v in f.items() if k in wanted} for f in calibration.feeds])
                typed = with_types(src, dst.with_name("typed.onnx"))
                rows: list[str] = []
                try:
                    quantize_static(
                        typed, dst, reader, quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                        activation_type=QuantType.QUInt8, **common,
                    )  # fmt: skip
                finally:
                    for f in typed.parent.glob(typed.name + "*"):
                        f.unlink()
            else:
                rows = _quantize_dynamic(src, dst, _row_nodes(before, nodes, options), common)
        finally:
            logging.disable(logging.NOTSET)
    return describe(before, nodes, onnx.load(str(dst)), options, rows)


def _quantize_dynamic(src: Path, dst: Path, rows: list[str], common: dict[str, Any]) -> list[str]:
    """ONNX Runtime's dynamic quantization of ``common["nodes_to_quantize"]`` into ``dst``, but ``rows``, which
    ``rowwise.quantize_rows`` makes per-row int8 first; returns ``rows``."""
    from onnxruntime.quantization import quantize_dynamic

    graph = src
    if rows:
        graph = dst.with_name("rows.onnx")
        _save_rows(src, graph, rows)
        common = {**common, "nodes_to_quantize": [n for n in common["nodes_to_quantize"] if n not in set(rows)]}
    try:
        if common["nodes_to_quantize"]:  # an empty list would mean "every node" to the quantizer
            quantize_dynamic(graph, dst, op_types_to_quantize=list(QUANTIZED_OPS), **common)
        else:
            shutil.copyfile(graph, dst)
    finally:
        if graph != src:
            for f in graph.parent.glob("rows.onnx*"):
                f.unlink()
    return rows


def _row_nodes_wanted(options: Int8Options) -> bool:
    return options.method == "dynamic" and options.activations == "row"


def _row_nodes(graph: onnx.ModelProto, nodes: list[str], options: Int8Options) -> list[str]:
    """The nodes of ``nodes`` whose activations get one scale per row (``options.activations``): the backbone's
    MatMuls of ROW_ROLES and, with ``options.adapter_rows``, the adapter path's MatMuls with a 2-D stored weight."""
    if not _row_nodes_wanted(options):
        return []
    roles = backbone_roles(graph)
    adapters = adapter_gemms(graph) if options.adapter_rows else set()
    return [n for n in nodes if (n in roles and roles[n][1] in ROW_ROLES) or n in adapters]


def adapter_gemms(graph: onnx.ModelProto) -> set[str]:
    """Names of the adapter blocks' MatMuls with a stored 2-D weight (the stacked down-projection; in a one-task graph
    the folded fusion matrices too): those per-row int8 (``rowwise.quantize_rows``) can rewrite."""
    weights = {t.name: t for t in graph.graph.initializer}
    return {
        n.name
        for n in graph.graph.node
        if n.op_type == "MatMul"
        and n.name.startswith(ADAPTER_NODES)
        and len(n.input) > 1
        and n.input[1] in weights
        and len(weights[n.input[1]].dims) == 2
    }


def _save_rows(src: Path, dst: Path, rows: list[str]) -> None:
    """``src`` with the MatMuls ``rows`` made per-row int8 (``rowwise.quantize_rows``), saved to ``dst``."""
    from .rowwise import quantize_rows

    graph = onnx.load(str(src))
    quantize_rows(graph, rows)
    onnx.save(graph, str(dst), save_as_external_data=src.stat().st_size > 1_800_000_000)


def quantizable(graph: onnx.ModelProto, options: Int8Options = DEFAULT_OPTIONS) -> list[str]:
    """Names of the nodes to quantize: every Attention, and every MatMul whose weight (second input) is an
    initializer — fixed at export, so it can be quantized once, ahead of time — but what ``options`` leaves in fp32:
    the adapter blocks' nodes (named ``/blocks.<layer>/...`` by the exporter, as the fp16 conversion relies on) when
    ``adapter_path`` is off, and the backbone nodes of ``fp32_roles`` and ``fp32_layers``."""
    weights = {t.name for t in graph.graph.initializer}
    roles = backbone_roles(graph)
    layers = max((layer for layer, _ in roles.values()), default=-1) + 1
    fp32 = {(i, role) for i in _layers("fp32_layers", options.fp32_layers, layers) for role in ROLES}
    for entry in options.fp32_roles:
        role, _, at = entry.partition(":")
        fp32 |= {(i, role) for i in (_layers("fp32_roles", (int(at),), layers) if at else range(layers))}
    out = []
    for n in graph.graph.node:
        if not (n.op_type == "Attention" or (n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in weights)):
            continue
        if n.name.startswith(ADAPTER_NODES):
            if options.adapter_path:
                out.append(n.name)
            continue
        if roles.get(n.name) not in fp32:
            out.append(n.name)
    return out


def _layers(what: str, indices: tuple[int, ...], layers: int) -> set[int]:
    """``indices`` (negative: from the last) as layer numbers; ExportError for one the graph does not have."""
    wrong = [i for i in indices if not -layers <= i < layers]
    if wrong:
        raise ExportError(f"{what}: no layer {wrong[0]} in a graph of {layers} layers (0..{layers - 1}, or -1 the last)")
    return {i % layers for i in indices}


def backbone_roles(graph: onnx.ModelProto) -> dict[str, tuple[int, str]]:
    """node name -> (layer, role in ROLES) for the backbone's fused Attention nodes and constant-weight MatMuls
    outside the adapter blocks. Found by order, not by name (names differ between architectures): a graph's nodes
    are topologically sorted, each layer starts with its Attention, and its three GEMMs follow in data order."""
    weights = {t.name for t in graph.graph.initializer}
    out: dict[str, tuple[int, str]] = {}
    layer, seen = -1, 0
    for n in graph.graph.node:
        if n.op_type == "Attention":
            layer, seen = layer + 1, 1
            out[n.name] = (layer, ROLES[0])
        elif _backbone_gemm(n, weights) and 0 < seen < len(ROLES):
            out[n.name] = (layer, ROLES[seen])
            seen += 1
    return out


def check_roles(roles: dict[str, tuple[int, str]], arch: str, layers: int) -> None:
    """Raises ExportError unless ``roles`` (``backbone_roles``) names all of ROLES in each of the ``layers`` layers: a
    layer whose attention did not fuse has no Attention to start from, and its GEMMs would be taken for another
    layer's or for none, leaving in fp32 other GEMMs than the options name."""
    found = Counter(layer for layer, _ in roles.values())
    whole = sum(found[i] == len(ROLES) for i in range(layers))
    if whole != layers or len(found) != layers:
        raise ExportError(
            f"int8: the {arch} graph has a fused Attention followed by its three GEMMs in {whole} of its {layers} layers "
            "(ONNX Runtime did not fuse every attention: see the export's 'did not fuse' warning), so the backbone "
            "GEMMs to leave in fp32, to smooth or to give per-row activation scales cannot be found; allowed: --int8-fp32 "
            "none (quantize every GEMM) with --int8-smooth none and --int8-activations tensor"
        )


def _backbone_gemm(node: onnx.NodeProto, weights: set[str]) -> bool:
    """A MatMul with a stored weight outside the adapter blocks."""
    return (
        node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in weights and not node.name.startswith(ADAPTER_NODES)
    )


def int8_graph(
    work: Path,
    fp32: object,
    model: FusionModel,
    max_seq_len: int,
    options: Int8Options,
    progress: bool,
    encoder: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """Quantize ``work``/model.onnx (the validated fp32 graph, whose session is ``fp32``) in place and gate it;
    (int8 session, the manifest's 'int8' record). With ``options.smooth_alpha``, the graph is smoothed first and the
    smoothed fp32 graph checked against ``fp32`` (``smooth.check_smoothed``); the gate compares the int8 graph with
    ``fp32``, the unsmoothed graph. ``encoder`` (serving.tokenize.Encoder) tokenizes ``options.calibration``.
    Raises Int8GateError or SmoothingError, leaving the fp32 graph in place; InputError for a bad calibration file;
    ExportError where the backbone GEMMs ``options`` leaves in fp32 cannot be found (``check_roles``)."""
    from tqdm import tqdm

    from fusionserve.serving.model.artifact import MODEL_FILE
    from fusionserve.serving.model.runtime import make_session

    from ..validate import count_cases
    from .smooth import smooth_checked

    src, dst = work / MODEL_FILE, work / "int8.onnx"
    backbone = (model.backbone.arch.name, model.backbone.n_layers)
    record: dict[str, Any] = {}
    calibration: Any = None
    if options.smooth_alpha is not None or options.method == "static":
        calibration = calibration_inputs(model, max_seq_len, options.calibration, encoder)
        for feed in calibration.feeds:  # a live graph's task tables (WithTables) are inputs too
            feed.update(getattr(fp32, "tables", {}))
    graph = src
    nodes = _to_smooth(src, options, backbone)
    if options.smooth_alpha is not None and nodes:  # none: static QDQ of QKV-only smoothing (no int8 Attention there)
        graph = work / "smoothed.onnx"
        record["smoothing"] = smooth_checked(src, graph, nodes, options.smooth_alpha, calibration, fp32, model, max_seq_len)
    record["quantization"] = quantize_graph(graph, dst, options, backbone, calibration)
    if calibration is not None and options.method == "static":
        record["quantization"]["calibration"] = calibration.describe()
    session = getattr(fp32, "like", lambda s: s)(make_session(dst, device="cpu"))  # a live graph: fed its tables too
    with tqdm(total=count_cases(model, max_seq_len), desc="int8 gate", unit="case", disable=not progress, leave=False) as bar:
        record["gate"] = check_int8(session, fp32, model, max_seq_len, options.gate, bar.update).as_dict()
    record["model_bytes"] = {"fp32": _bytes(src), "int8": _bytes(dst)}
    for f in work.glob("smoothed.onnx*"):
        f.unlink()
    dst.replace(src)  # the session holds the graph in memory; the artifact keeps only the int8 file
    return session, record


def _to_smooth(src: Path, options: Int8Options, backbone: tuple[str, int]) -> list[str]:
    """The quantized backbone GEMMs of ``options.smooth_roles`` (none without smoothing); ExportError where the roles
    cannot be found (``check_roles``)."""
    if options.smooth_alpha is None:
        return []
    before = onnx.load(str(src), load_external_data=False)
    roles = backbone_roles(before)
    check_roles(roles, *backbone)  # the GEMMs to smooth are found by role, as those left in fp32
    attention = {n.name for n in before.graph.node if n.op_type == "Attention"}  # static QDQ leaves them fp32
    return [
        n
        for n in quantizable(before, options)
        if roles.get(n, (0, ""))[1] in options.smooth_roles and not (options.method == "static" and n in attention)
    ]


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
