"""The folded model -> one ONNX graph, then ONNX Runtime's transformer optimizer (fused Attention,
SkipLayerNormalization, EmbedLayerNormalization, BiasGelu) and, for GPU, fp16. The optimizer's model_type and the
fused counts to expect come from the backbone's architecture (``backbone.py``)."""

from __future__ import annotations

import importlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from fusionserve.errors import FusionServeError
from fusionserve.serving.private import ORT_OPTIMIZER, skip_simplified_norms_where_present

from .fusion import AdapterLayerBlock
from .model import FusionModel

# The model's inputs; the exporter drops those the graph does not read (token_type_ids without token types, task_id
# with a single head-only task), so the manifest lists the graph's own inputs.
INPUTS = ("input_ids", "attention_mask", "token_type_ids", "task_id")
# The graph's outputs: token_logits only in a graph with a token-level head (FusionModel.outputs)
OUTPUTS = ("logits", "fusion_activations", "token_logits")
DEFAULT_OPSET = 17
# the opsets an export can be written in: below 11 torch's exporter cannot write the model's dynamic Slice and Pad
# (tried: 7, 9, 10 fail); 23 is the newest ONNX Runtime 1.32 reads. int8 needs 13 (int8/rowwise.py: MIN_OPSET).
OPSETS = range(11, 24)
# ONNX files are protobufs, capped at 2 GiB; past this size the weights go to an external data file.
EXTERNAL_DATA_BYTES = 1_800_000_000


class ExportError(FusionServeError):
    """The graph could not be exported or optimized as asked."""


@dataclass(frozen=True)
class FusionReport:
    """Fused-operator counts after optimization against what a fully fused model of this architecture and shape has."""

    counts: dict[str, int]
    expected: dict[str, int]

    @property
    def missing(self) -> dict[str, tuple[int, int]]:
        """Operator -> (found, expected) for every kind that fused less than expected."""
        return {op: (self.counts.get(op, 0), want) for op, want in self.expected.items() if self.counts.get(op, 0) < want}

    def describe(self) -> str:
        if not self.missing:
            return "all fused: " + ", ".join(f"{op} {n}" for op, n in self.expected.items())
        return "did not fuse: " + ", ".join(f"{op} {got}/{want}" for op, (got, want) in self.missing.items())


def expected_fusions(model: FusionModel) -> dict[str, int]:
    """Per layer one Attention, a SkipLayerNormalization after attention and after the FFN, one more where an adapter
    stack reads LN(f + a) (``original_ln_before``); the embeddings as one EmbedLayerNormalization (a LayerNormalization
    where ONNX Runtime does not fuse them: RoBERTa, XLM-RoBERTa); BiasGelu where the FFN uses gelu."""
    bb = model.backbone
    layers = bb.n_layers
    ln_before = sum(isinstance(b, AdapterLayerBlock) and b.ln_before for b in model.blocks)
    embed = "EmbedLayerNormalization" if bb.arch.embed_fusion else "LayerNormalization"
    expected = {embed: 1, "Attention": layers, "SkipLayerNormalization": 2 * layers + ln_before}
    if bb.ffn_act == "gelu":
        expected["BiasGelu"] = layers
    return expected


def _sample_inputs(model: FusionModel) -> tuple[torch.Tensor, ...]:
    ids = torch.full((2, 8), 1000 % model.backbone.vocab_size, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return ids, mask, torch.zeros_like(ids), torch.zeros(1, dtype=torch.long)


def _drop_duplicate_casts(graph: onnx.GraphProto) -> None:
    """The fp16 converter inserts one Cast per fp32 consumer of an fp16 tensor, all with the same output name;
    they are identical, so keep the first (ONNX wants each name assigned once)."""
    seen: set[str] = set()
    keep = []
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in seen:
            continue
        seen.update(node.output)
        keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def export_raw(model: FusionModel, path: Path, opset: int = DEFAULT_OPSET, live: bool = False) -> None:
    """Trace the model into ``path`` with the TorchScript exporter (the graph shape the optimizer's BERT
    patterns expect); dynamic batch and sequence axes. ``live``: every per-task tensor is a graph input with a dynamic
    task axis (``live.py``) instead of a stored weight. Raises ExportError (SpecError: heads of several forms, live)."""
    model.eval()  # the tracer restores the wrapper's training flag onto submodules: keep it False
    axes = {name: {0: "batch", 1: "sequence"} for name in INPUTS[:3]}
    axes["task_id"] = {0: "task_rows"}  # 1 (one task for the batch) or batch (a task per row)
    axes |= {"logits": {0: "batch"}, "fusion_activations": {0: "batch", 2: "sequence"}}
    axes |= {"token_logits": {0: "batch", 1: "sequence"}} if "token_logits" in model.outputs else {}
    traced: torch.nn.Module = model
    sample, names = _sample_inputs(model), list(INPUTS)
    if live:
        from .live.tables import LiveGraph, task_tables

        tables = {k: v.clone() for k, v in task_tables(model).items()}  # not the buffers: the tracer tracks tensors
        traced = LiveGraph(model, list(tables)).eval()  # eval, as the model: see above
        sample += tuple(tables.values())
        names += list(tables)
        axes |= {name: {0: "tasks"} for name in tables}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about python control flow on constant shapes
        try:
            torch.onnx.export(
                traced,
                sample,
                str(path),
                dynamo=False,
                opset_version=opset,
                input_names=names,
                output_names=list(model.outputs),
                dynamic_axes=axes,
                do_constant_folding=True,
            )
        except Exception as exc:  # the exporter raises many types; all mean the same thing to the user
            raise ExportError(f"ONNX export failed (opset {opset}): {exc}") from exc


# ONNX Runtime's fusion passes that can never match a graph fusionserve exports, switched off in its FusionOptions:
# rotary embeddings (the position encoding of LLaMA-style decoders; the BERT family adds learned position embeddings)
# and QOrdered MatMul (a graph quantized with QuantizeLinear/DequantizeLinear pairs; the graph is optimized before int8
# quantizes it). Each searched the whole graph for nothing; the optimized graphs are the same, byte for byte, with or
# without them (benchmarks/RESULTS.md, "The optimize step of an export").
IDLE_PASSES = ("enable_rotary_embeddings", "enable_qordered_matmul")


def fusion_options(tool: Any, model_type: str) -> Any:
    """The optimizer's own options for ``model_type`` (``tool``: ORT_OPTIMIZER's module), IDLE_PASSES off."""
    options = tool.FusionOptions(model_type)
    for name in IDLE_PASSES:
        setattr(options, name, False)
    return options


def optimize(raw: Path, out: Path, model: FusionModel, precision: str) -> FusionReport:
    """Apply ONNX Runtime's BERT fusions (and fp16 conversion) to ``raw``, write ``out``; returns the fused counts.

    fp16 keeps inputs and outputs in their types, and keeps Softmax (the fusion weights) in fp32; the fused
    kernels accumulate LayerNorm and attention in fp32 themselves."""
    tool = importlib.import_module(ORT_OPTIMIZER)  # outside ONNX Runtime's API: serving/private.py

    bb = model.backbone
    kind = bb.arch.optimizer_model_type
    with warnings.catch_warnings(), skip_simplified_norms_where_present(tool, kind):
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the optimizer logs its own notes; what matters is checked below
        try:
            opt = tool.optimize_model(
                str(raw),
                model_type=kind,
                num_heads=bb.n_heads,
                hidden_size=bb.hidden_size,
                optimization_options=fusion_options(tool, kind),
                opt_level=0,
            )
        finally:
            logging.disable(logging.NOTSET)
    counts = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    if precision == "fp16":
        # The adapter stacks and fusion scores stay fp32: softmax over large fusion scores is where fp16 rounding
        # shows (trained fusions are sharp), and they cost a few percent of the layer. The backbone goes fp16.
        adapter_nodes = [n.name for n in opt.model.graph.node if n.name.startswith("/blocks.")]
        opt.convert_float_to_float16(keep_io_types=True, op_block_list=["Softmax"], node_block_list=adapter_nodes)
        _drop_duplicate_casts(opt.model.graph)
    elif precision != "fp32":
        raise ExportError(f"unknown precision '{precision}'; allowed: fp32, fp16")
    size = opt.model.ByteSize()
    opt.save_model_to_file(str(out), use_external_data_format=size > EXTERNAL_DATA_BYTES)
    onnx.checker.check_model(str(out))
    return FusionReport(counts, expected_fusions(model))
