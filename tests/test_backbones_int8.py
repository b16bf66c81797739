"""int8 on every backbone x adapter architecture: the fp32 artifact of each (``arch_exported``) quantized and gated as
`export --precision int8` does once its fp32 graph passed parity, the roles ``backbone_roles`` finds by node order
(each layer's fused Attention, then its three GEMMs) checked against the backbone's own weights, none on the
adapter and fusion nodes, labels as fp32's on the test sentences and pairs; one `export --precision int8` through the
command line on a non-BERT backbone. A graph whose attention did not fuse: export warns (and records it), and int8
refuses to guess which GEMMs to leave in fp32, naming the backbone."""

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fusionserve.export.artifact import export_artifact
from fusionserve.export.build import build_model
from fusionserve.export.int8.quantize import DEFAULT_OPTIONS, ROLES, Int8Options, backbone_roles, int8_graph, quantizable
from fusionserve.export.onnx_export import ExportError
from fusionserve.export.spec import load_spec
from fusionserve.export.validate import BATCH_SIZES, Remembered
from fusionserve.serving.model.artifact import MODEL_FILE, load_artifact, write_manifest
from fusionserve.serving.model.predictions import TextInput, softmax
from fusionserve.serving.model.runtime import OnnxRunner, make_session
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.backbone_models import HIDDEN, LAYERS, TASKS
from tests.export_helpers import ARCH_MAX_SEQ_LEN, _cli

ADAPTER_NODES = "/blocks."  # the exporter's names for the adapter and fusion nodes


def int8_copy(fp32: Path, spec: Path, out: Path, options: Int8Options = DEFAULT_OPTIONS) -> Path:
    """``out``: the fp32 artifact ``fp32`` quantized and gated by ``export.quantize.int8_graph``, the step `export
    --precision int8` runs on its validated fp32 graph, without exporting and validating that graph again."""
    manifest = load_artifact(fp32).manifest
    shutil.copytree(fp32, out)
    model = build_model(load_spec(spec))
    fp32_session = Remembered(make_session(out / MODEL_FILE, device="cpu"))  # as the export hands it over
    _, record = int8_graph(out, fp32_session, model, manifest["max_seq_len"], options, False)
    write_manifest(out, {**manifest, "precision": "int8", "int8": record})
    return out


@pytest.fixture(scope="module")
def arch_int8(arch_built, arch_exported, tmp_path_factory) -> Path:
    return int8_copy(arch_exported.folder, arch_built.spec, tmp_path_factory.mktemp("arch-int8") / "artifact")


def test_int8_passes_its_gate_on_every_backbone(arch_built, arch_int8):
    manifest = load_artifact(arch_int8).manifest  # checksums hold
    gate, q = manifest["int8"]["gate"], manifest["int8"]["quantization"]
    assert manifest["precision"] == "int8" and manifest["base_model"]["architecture"] == arch_built.arch
    assert gate["label_agreement"] >= gate["thresholds"]["min_label_agreement"]
    assert 0 < gate["max_probability_change"] <= gate["thresholds"]["max_probability_change"]
    # every task at sequences 5 and 37 (ARCH_MAX_SEQ_LEN), and at each a batch of 8 rows cycling through the 4 tasks
    assert gate["rows"] == (len(TASKS) * sum(BATCH_SIZES) + BATCH_SIZES[-1]) * 2
    # per layer the attention output and both FFN GEMMs, and at every fusion layer (one or two per layer: all hold
    # adapters) the adapters' stacked down-projection, all with per-row activations: every GEMM by default
    sites = len(manifest["fusion_layers"])
    assert q["quantized"] == {"MatMul": 3 * LAYERS + sites, "Attention": LAYERS}
    assert "backbone GEMMs" not in q["kept_fp32"] and q["fp32_roles"] == []
    ops = Counter(n.op_type for n in onnx.load(str(arch_int8 / MODEL_FILE), load_external_data=False).graph.node)
    assert ops["QAttention"] == LAYERS and ops["Attention"] == 0
    assert ops["MatMulIntegerToFloat"] == 3 * LAYERS + sites and ops["MatMulInteger"] == 0


def _source(params: dict[str, np.ndarray], weight: np.ndarray) -> list[str]:
    """The backbone parameters whose transpose is ``weight`` (a MatMul's stored weight is the Linear's, transposed)."""
    return [name for name, p in params.items() if p.shape == weight.T.shape and np.array_equal(p, weight.T)]


def test_backbone_roles_by_node_order_are_right_on_every_backbone(arch_built, arch_exported):
    """Every role of every layer names the node whose weight is that layer's own (found among the backbone's
    parameters by value: names differ between architectures); no adapter or fusion node has a role, and every other
    stored-weight MatMul has one."""
    graph = onnx.load(str(arch_exported.folder / MODEL_FILE))
    roles = backbone_roles(graph)
    assert sorted(roles.values()) == sorted((layer, role) for layer in range(LAYERS) for role in ROLES)
    weights = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    nodes = {n.name: n for n in graph.graph.node}
    bb = build_model(load_spec(arch_built.spec)).backbone
    params = {name: p.detach().numpy() for name, p in bb.model.named_parameters() if p.dim() == 2}
    shapes = {"attention_qkv": (HIDDEN, 3 * HIDDEN), "attention_out": (HIDDEN, HIDDEN), "ffn_in": (HIDDEN, 37),
              "ffn_out": (37, HIDDEN)}  # fmt: skip
    for name, (layer, role) in roles.items():
        weight = weights[nodes[name].input[1]]
        assert weight.shape == shapes[role], (name, role)
        source = _source(params, weight[:, :HIDDEN] if role == "attention_qkv" else weight)  # QKV: the query's columns
        assert len(source) == 1 and f"layer.{layer}." in source[0], (name, layer, role, source)
        if role in ("attention_out", "ffn_out"):  # and those the backbone itself names
            linear = (bb.attention_output if role == "attention_out" else bb.ffn_output)(layer)[0]
            assert np.array_equal(weight.T, linear.weight.detach().numpy()), (name, layer, role)
    stored = {n.name for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    adapters = {n for n in stored if n.startswith(ADAPTER_NODES)}
    assert adapters and not adapters & set(roles)  # the adapter blocks' down-projections have no role
    assert stored - adapters <= set(roles)  # every backbone GEMM has one
    # what the options leave in fp32 follows the roles: the FFN's output GEMMs, or the last layer (by default none)
    everything = set(quantizable(graph, Int8Options(fp32_roles=())))
    assert everything == set(quantizable(graph))
    ffn_out = everything - set(quantizable(graph, Int8Options(fp32_roles=("ffn_out",))))
    assert ffn_out == {n for n, (_, role) in roles.items() if role == "ffn_out"}
    last = everything - set(quantizable(graph, Int8Options(fp32_roles=(), fp32_layers=(-1,))))
    assert last == {n for n, (layer, _) in roles.items() if layer == LAYERS - 1}


def test_int8_labels_agree_with_fp32_on_the_test_inputs(arch_exported, arch_int8):
    fp32, quantized = OnnxRunner(arch_exported.folder, device="cpu"), OnnxRunner(arch_int8, device="cpu")
    limit = DEFAULT_OPTIONS.gate.max_probability_change
    moved = 0.0
    for task in TASKS:
        for inputs in ([TextInput(s) for s in SENTENCES], [TextInput(a, b) for a, b in PAIRS]):
            want, _ = fp32.logits(task, inputs)
            got, _ = quantized.logits(task, inputs)
            np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=task)
            change = float(np.abs(softmax(got.astype(np.float64)) - softmax(want.astype(np.float64))).max())
            assert change <= limit, f"{task}: probability moved by {change:.3f}"
            moved = max(moved, float(np.abs(got - want).max()))
    assert moved > 1e-4  # beyond fp32's tolerance: it really ran in int8


def test_cli_export_int8_on_a_houlsby_distilbert(arch_models, tmp_path, capsys):
    built = arch_models("distilbert", "double_seq_bn")
    art = tmp_path / "int8"
    code, out, err = _cli(capsys, "export", built.spec, "--out", art, "--precision", "int8", "--max-seq-len", ARCH_MAX_SEQ_LEN)
    assert code == 0, err
    assert f"wrote {art}: {len(TASKS)} task(s), int8" in out and "int8 gate   vs the fp32 graph over" in out
    code, out, _ = _cli(capsys, "inspect", art)
    assert code == 0 and "base model  distilbert, 3 layers" in out and f"quantized MatMul {3 * LAYERS + 2 * LAYERS}/" in out
    text, pair = PAIRS[0]
    code, out, err = _cli(capsys, "predict", art, "--task", "dyn", "--text", text, "--text-pair", pair)
    assert code == 0, err
    assert json.loads(out)["label"] in TASKS["dyn"][3]


def test_a_graph_whose_attention_did_not_fuse(arch_models, tmp_path, capsys, monkeypatch):
    """ONNX Runtime's attention fusion switched off: export warns on stderr and records it (the artifact is still
    exact), and int8 refuses to guess the GEMMs to leave in fp32 (there is no Attention to count layers from), naming
    the backbone and what is allowed; with none left in fp32 it quantizes every GEMM and passes its gate."""
    from onnxruntime.transformers import optimizer

    real = optimizer.optimize_model

    def without_attention(*args, optimization_options, **kwargs):  # the exporter's own options, attention off too
        optimization_options.enable_attention = False
        return real(*args, optimization_options=optimization_options, **kwargs)

    monkeypatch.setattr(optimizer, "optimize_model", without_attention)
    built = arch_models("distilbert", "seq_bn")
    fp32 = tmp_path / "fp32"
    manifest = export_artifact(built.spec, fp32, max_seq_len=ARCH_MAX_SEQ_LEN, progress=False)
    warning = f"did not fuse: EmbedLayerNormalization 0/1, Attention 0/{LAYERS}"  # the embeddings' pattern needs it
    assert f"fusionserve export: warning: {warning}\n" in capsys.readouterr().err
    assert manifest["fused_operators"]["summary"] == warning and manifest["parity"]["max_abs_diff"]["logits"] <= 1e-4
    graph = onnx.load(str(fp32 / MODEL_FILE), load_external_data=False)
    assert backbone_roles(graph) == {}
    with pytest.raises(ExportError) as exc:
        int8_copy(fp32, built.spec, tmp_path / "int8")
    message = str(exc.value)
    assert "int8: the distilbert graph has a fused Attention followed by its three GEMMs in 0 of its 3 layers" in message
    assert "'did not fuse' warning" in message and "allowed: --int8-fp32 none (quantize every GEMM)" in message
    allowed = r"cannot be found; allowed: --int8-fp32 none .* with --int8-smooth none and --int8-activations tensor"
    with pytest.raises(ExportError, match=allowed):
        int8_copy(fp32, built.spec, tmp_path / "smoothed", Int8Options(smooth_alpha=0.5, activations="tensor"))  # by role
    with pytest.raises(ExportError, match=allowed):  # so are the GEMMs given per-row activation scales
        int8_copy(fp32, built.spec, tmp_path / "rows", Int8Options(smooth_alpha=None, activations="row"))
    every = int8_copy(fp32, built.spec, tmp_path / "every", Int8Options(smooth_alpha=None, activations="tensor"))
    q = load_artifact(every).manifest["int8"]["quantization"]
    assert q["quantized"] == {"MatMul": len(quantizable(graph, Int8Options(fp32_roles=()))), "Attention": 0}
    assert "backbone GEMMs" not in q["kept_fp32"]
