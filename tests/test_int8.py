"""`fusionserve export --precision int8`: the tiny model's int8 graph passes its gate, which is recorded in the manifest
and shown by `inspect`; a tightened gate refuses the same graph and writes nothing; int8 labels agree with fp32 on
the test inputs; the gate also checks batches mixing every task; `score` and `evaluate` on an int8 artifact answer as
its runtime does on the same batches; `prune --precision int8`. Serving an int8 artifact over HTTP is in
test_int8_serving.py."""

import contextlib
import io
import json
from collections import Counter
from dataclasses import asdict

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fusionserve.cli.main import build_parser, main
from fusionserve.cli.model_commands import int8_options
from fusionserve.export.artifact import export_artifact
from fusionserve.export.build import build_model
from fusionserve.export.int8.quantize import (
    DEFAULT_OPTIONS,
    ROLES,
    Int8Gate,
    Int8GateError,
    Int8Options,
    backbone_roles,
    check_int8,
    quantizable,
)
from fusionserve.export.onnx_export import ExportError
from fusionserve.export.spec import load_spec
from fusionserve.export.validate import BATCH_SIZES, count_cases, tolerances
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.predictions import TextInput, label_scores, softmax
from fusionserve.serving.model.runtime import OnnxRunner, make_session
from tests.adapterhub_models import TASKS
from tests.export_helpers import _cli, default_int8
from tests.runtime_helpers import MAX_SEQ_LEN, _batches
from tests.score_helpers import _read, _texts, _write

# one worker for both int8 modules under xdist, so that they read one default int8 export (export_helpers.default_int8)
pytestmark = pytest.mark.xdist_group("int8_default")

LAYERS = 3
# per layer: the attention output, both feed-forward GEMMs and the adapters' stacked down-projection, each with per-row
# activations (rowwise.py; the adapters' per tensor before issue 38); the fusion matrices of this 7-task graph are
# picked by the task index at run time and stay fp32
ROW_MATMULS = 4 * LAYERS
QUANTIZED_MATMULS = ROW_MATMULS


@pytest.fixture(scope="module")
def int8(built_st, tmp_path_factory):
    return default_int8(built_st.spec, MAX_SEQ_LEN, tmp_path_factory)  # the same export as test_int8_rowwise.py's


def test_int8_export_passes_its_gate_and_records_it(built_st, int8):
    folder, manifest = int8
    assert manifest["precision"] == "int8" and load_artifact(folder).manifest == manifest  # checksums hold
    # the fp32 graph matched PyTorch to fp32's tolerance before it was quantized
    assert manifest["parity"]["precision"] == "fp32" and manifest["parity"]["tolerance"] == tolerances(
        "fp32", ("logits", "fusion_activations")
    )
    gate = manifest["int8"]["gate"]
    assert gate["thresholds"] == asdict(DEFAULT_OPTIONS.gate)
    assert gate["label_agreement"] >= gate["thresholds"]["min_label_agreement"]
    assert 0 < gate["max_probability_change"] <= gate["thresholds"]["max_probability_change"]  # > 0: it did change
    # every task over the grid (at MAX_SEQ_LEN: sequence 5 only), then one batch of 8 rows cycling through the 7 tasks
    assert gate["rows"] == len(TASKS) * sum(BATCH_SIZES) + 8 and gate["cases"] == len(TASKS) * len(BATCH_SIZES) + 1
    assert gate["cases"] == count_cases(build_model(load_spec(built_st.spec)), MAX_SEQ_LEN)  # the progress bar's total

    # smoothed by default (QKV), calibrated on the validation grid without a calibration file
    smooth = manifest["int8"]["smoothing"]
    assert smooth["alpha"] == DEFAULT_OPTIONS.smooth_alpha and smooth["gemms"] == LAYERS
    assert smooth["calibration"]["source"] == "validation grid (random token ids)" and smooth["fp32_max_abs_diff"] <= 1e-5
    q = manifest["int8"]["quantization"]
    assert q["quantized"] == {"MatMul": QUANTIZED_MATMULS, "Attention": LAYERS}
    kept = {op: k["count"] for op, k in q["kept_fp32"].items()}
    assert kept["embeddings"] == 1 and kept["LayerNorm"] == 3 * LAYERS and kept["Softmax"] == LAYERS
    assert kept["heads"] == 2 * len(TASKS)  # two linears each
    assert kept["MatMul without stored weights"] == 4 * LAYERS  # per layer: the task's fusion matrices (3), placement
    assert "backbone GEMMs" not in kept and q["fp32_roles"] == []  # every backbone GEMM is int8
    assert manifest["int8"]["model_bytes"]["int8"] < manifest["int8"]["model_bytes"]["fp32"]


def test_int8_graph_quantizes_the_gemms_and_keeps_the_rest_in_fp32(built_st, int8):
    folder, _ = int8
    graph = onnx.load(str(folder / "model.onnx")).graph
    ops = Counter(n.op_type for n in graph.node)
    assert (ops["QAttention"], ops["Attention"], ops["MatMulInteger"]) == (LAYERS, 0, QUANTIZED_MATMULS - ROW_MATMULS)
    assert ops["MatMulIntegerToFloat"] == ROW_MATMULS and ops["QuantizeLinear"] == ROW_MATMULS  # one scale per row
    assert ops["SkipLayerNormalization"] == 3 * LAYERS and ops["Softmax"] == LAYERS and ops["EmbedLayerNormalization"] == 1
    by_type = Counter()
    for t in graph.initializer:
        if not t.name.endswith(("_zero_point", "_scale")):  # one of each per output column beside every int8 weight
            by_type[t.data_type] += int(np.prod(t.dims))
    model = build_model(load_spec(built_st.spec))
    layers = model.backbone.model.encoder.layer
    gemms = sum(m.weight.numel() for layer in layers for m in (layer.attention.self.query, layer.attention.self.key,
                layer.attention.self.value, layer.attention.output.dense, layer.intermediate.dense,
                layer.output.dense))  # fmt: skip
    down = sum(block.down_w.numel() for block in model.blocks if hasattr(block, "down_w"))  # adapter sites only
    # per-row GEMMs (rowwise.py) carry int8 rows beyond K that subtract each row's zero point: (K + J, N) weights
    inits = {t.name: t for t in graph.initializer}
    zero_point_rows = sum(
        (t.dims[0] - int(numpy_helper.to_array(inits[name.replace("_wq", "_rows_k")])[1])) * t.dims[1]
        for name, t in inits.items()
        if name.endswith("_wq")
    )
    assert 0 < zero_point_rows < (gemms + down) / 4
    assert by_type[onnx.TensorProto.INT8] == gemms + down + zero_point_rows  # the backbone's GEMMs and adapters' down
    embeddings = model.backbone.model.embeddings.word_embeddings.weight.numel()
    assert by_type[onnx.TensorProto.FLOAT] > embeddings  # those stay float (with the rest)
    assert [i.type.tensor_type.elem_type for i in graph.input] == [onnx.TensorProto.INT64] * 4
    assert [o.type.tensor_type.elem_type for o in graph.output] == [onnx.TensorProto.FLOAT] * 2


def test_backbone_roles_and_what_the_options_leave_in_fp32(built_st, artifacts):
    graph = onnx.load(str(artifacts.fp32 / "model.onnx"), load_external_data=False)
    roles = backbone_roles(graph)
    assert sorted(roles.values()) == sorted((layer, role) for layer in range(LAYERS) for role in ROLES)
    # checked against the weights' shapes: (hidden, 3 hidden) QKV, (hidden, hidden), (hidden, ffn), (ffn, hidden)
    hidden, ffn = 32, 37
    shapes = {t.name: tuple(t.dims) for t in graph.graph.initializer}
    want = {
        "attention_qkv": (hidden, 3 * hidden),
        "attention_out": (hidden, hidden),
        "ffn_in": (hidden, ffn),
        "ffn_out": (ffn, hidden),
    }
    nodes = {n.name: n for n in graph.graph.node}
    assert all(shapes[nodes[name].input[1]] == want[role] for name, (_, role) in roles.items())

    everything = set(quantizable(graph, Int8Options(fp32_roles=())))
    assert set(roles) < everything  # the adapter path's down-projections too
    by_role = {name for name, (_, role) in roles.items() if role in ("ffn_out", "attention_qkv")}
    assert everything - set(quantizable(graph, Int8Options(fp32_roles=("ffn_out", "attention_qkv")))) == by_role
    by_layer = {name for name, (layer, _) in roles.items() if layer in (0, LAYERS - 1)}
    assert everything - set(quantizable(graph, Int8Options(fp32_roles=(), fp32_layers=(0, -1)))) == by_layer
    assert set(quantizable(graph)) == everything  # by default every GEMM
    with pytest.raises(
        ValueError,
        match="fp32_roles: unknown entry 'ffn'; allowed: attention_qkv, attention_out, ffn_in, ffn_out, each optionally",
    ):
        Int8Options(fp32_roles=("ffn",))
    with pytest.raises(ExportError, match=r"fp32_layers: no layer 3 in a graph of 3 layers \(0..2, or -1 the last\)"):
        quantizable(graph, Int8Options(fp32_layers=(0, 3)))


def test_int8_labels_agree_with_fp32_on_the_test_inputs(artifacts, int8):
    fp32, quantized = OnnxRunner(artifacts.fp32, device="cpu"), OnnxRunner(int8[0], device="cpu")
    limit = DEFAULT_OPTIONS.gate.max_probability_change
    moved = 0.0
    for task in TASKS:
        for what, inputs in _batches().items():
            want, _ = fp32.logits(task, inputs)
            got, _ = quantized.logits(task, inputs)
            np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=f"{task} {what}")
            change = float(np.abs(softmax(got.astype(np.float64)) - softmax(want.astype(np.float64))).max())
            assert change <= limit, f"{task} {what}: probability moved by {change:.3f}"
            moved = max(moved, float(np.abs(got - want).max()))
    assert moved > 1e-4  # beyond fp32's tolerance: it really ran in int8


def test_tightened_gate_refuses_with_every_failing_figure_and_writes_nothing(built_st, int8, tmp_path):
    passed = int8[1]["int8"]["gate"]  # the same graph, measured under the default gate
    out = tmp_path / "artifact"
    strict = Int8Options(gate=Int8Gate(min_label_agreement=1.0, max_probability_change=0.0))
    with pytest.raises(Int8GateError) as exc:
        export_artifact(built_st.spec, out, "int8", max_seq_len=MAX_SEQ_LEN, progress=False, int8=strict)
    message = str(exc.value)
    assert "no artifact written" in message
    assert f"max probability change {passed['max_probability_change']:.3g} > 0 at task " in message
    # label agreement is listed exactly when it, too, falls short of 100% (ties can flip on int8 kernels)
    assert (f"label agreement {passed['label_agreement']:.2%}" in message) == (passed["label_agreement"] < 1.0)
    assert list(tmp_path.iterdir()) == []


class _FirstRowsTask:
    """An "int8" session that is the fp32 one, but answers every row of a batch for the first row's task (what a graph
    that ignored per-row task ids would do): right on every single-task batch, wrong on mixed ones."""

    def __init__(self, session):
        self._session = session

    def get_inputs(self):
        return self._session.get_inputs()

    def run(self, names, feed):
        return self._session.run(names, {**feed, "task_id": feed["task_id"][:1]})


def test_int8_gate_checks_batches_mixing_every_task(built_st, artifacts):
    session = make_session(artifacts.fp32 / "model.onnx", threads=1, device="cpu")
    model = build_model(load_spec(built_st.spec))
    gate = Int8Gate(min_label_agreement=0.0, max_probability_change=1e-6)
    same = check_int8(session, session, model, MAX_SEQ_LEN, gate)  # the fp32 graph against itself passes
    assert same.cases == count_cases(model, MAX_SEQ_LEN) and same.rows == len(TASKS) * sum(BATCH_SIZES) + 8
    with pytest.raises(Int8GateError, match=r"max probability change \S+ > 1e-06 at mixed tasks, batch 8, sequence 5"):
        check_int8(_FirstRowsTask(session), session, model, MAX_SEQ_LEN, gate)


def test_score_and_evaluate_on_int8_answer_as_its_runtime_on_the_same_batches(int8, tmp_path, capsys):
    """int8's activation scales are computed per batch, so a row's answer can depend on its batch: compare with the
    runtime on the batches each command forms (score: by token length; evaluate: in input order)."""
    runner = OnnxRunner(int8[0], 1, device="cpu")
    labels = runner.labels["rte"]
    texts = _texts(13, seed=3)
    src = _write(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    dst = tmp_path / "out.jsonl"
    argv = ["score", int8[0], "--task", "rte", "--input", src, "--output", dst, "--batch-size", 4, "--threads", 1]
    code, out, _ = _cli(capsys, *argv, "--all-scores")
    assert code == 0, out
    encoded = runner.encoder.encode([TextInput(t) for t in texts])
    order = sorted(range(len(texts)), key=encoded.attention_mask.sum(axis=1).__getitem__)
    want: dict[int, tuple[str, float, dict[str, float]]] = {}
    for start in range(0, len(order), 4):
        idx = order[start : start + 4]
        want |= dict(zip(idx, label_scores(labels, runner.run("rte", encoded.rows(idx)).logits), strict=True))
    rows = _read(dst)
    assert [r["id"] for r in rows] == list(range(len(texts)))
    for i, r in enumerate(rows):
        assert r["label"] == want[i][0], f"row {i}"
        assert [r[f"score_{x}"] for x in labels] == pytest.approx(list(want[i][2].values()), abs=2e-6)

    got = [runner.run("rte", runner.encoder.encode([TextInput(t) for t in texts[k : k + 5]])).logits for k in (0, 5, 10)]
    predicted = np.argmax(np.concatenate(got), axis=-1)
    # the first eight labelled as the int8 runtime predicts them in batches of 5, the rest as something else: 8 of 13
    marked = [labels[p] if k < 8 else labels[(p + 1) % len(labels)] for k, p in enumerate(predicted)]
    src = _write(tmp_path / "labelled.jsonl", [{"text": t, "label": x} for t, x in zip(texts, marked, strict=True)])
    code, out, _ = _cli(capsys, "evaluate", int8[0], "--task", "rte", "--input", src, "--batch-size", 5, "--json")
    assert code == 0 and (json.loads(out)["examples"], json.loads(out)["correct"]) == (13, 8)


def test_gate_thresholds_are_checked():
    with pytest.raises(ValueError, match="min_label_agreement must be in"):
        Int8Gate(min_label_agreement=1.5)
    with pytest.raises(ValueError, match="max_probability_change must be in"):
        Int8Gate(max_probability_change=-0.1)


@pytest.fixture(scope="module")
def cli_int8(built_st, tmp_path_factory):
    """``fusionserve export SPEC --precision int8 --max-seq-len 16``, the int8 flags left at their defaults: the folder
    and what it printed. Once for the module: the two command-line tests below read the same export."""
    art = tmp_path_factory.mktemp("cli-int8") / "int8"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["export", str(built_st.spec), "--out", str(art), "--precision", "int8", "--max-seq-len", "16"])
    assert code == 0, out.getvalue() + err.getvalue()
    return art, out.getvalue()


def test_cli_export_int8_inspect_and_prune(built_st, stats, cli_int8, tmp_path, capsys):
    art, out = cli_int8
    assert f"wrote {art}: {len(TASKS)} task(s), int8" in out and "int8 gate   vs the fp32 graph over" in out
    gate = load_artifact(art).manifest["int8"]["gate"]
    code, out, _ = _cli(capsys, "inspect", art)
    assert code == 0 and "int8, opset 17" in out and "of the fp32 graph before quantization" in out
    assert f"label agreement {gate['label_agreement']:.2%} (min 85%)" in out
    assert f"max probability change {gate['max_probability_change']:.3f} (max 0.3)" in out
    assert "quantized MatMul 12/24, Attention 3/3" in out and "one scale and zero point per row (token)" in out

    pruned = tmp_path / "pruned"
    argv = ["prune", built_st.spec, "--stats", stats, "--keep-top", "1", "--tasks", "rte", "--out", pruned]
    code, out, _ = _cli(capsys, *argv, "--precision", "int8", "--max-seq-len", 16)
    assert code == 0, out
    manifest = load_artifact(pruned).manifest
    assert manifest["precision"] == "int8" and manifest["pruning"]["tasks"]["rte"]["kept"]
    gate = manifest["int8"]["gate"]
    assert gate["label_agreement"] >= gate["thresholds"]["min_label_agreement"]
    code, out, _ = _cli(capsys, "predict", pruned, "--task", "rte", "--text", "the movie was great")
    assert code == 0 and '"label": ' in out


def test_cli_int8_fp32_chooses_the_gemms_left_in_fp32(built_st, stats, cli_int8, tmp_path, capsys):
    # --int8-fp32 none gives exactly the default options (so the same export as cli_int8's): every GEMM in int8
    given = ["export", str(built_st.spec), "--out", str(tmp_path / "every"), "--precision", "int8", "--max-seq-len", "16"]
    none = int8_options(build_parser().parse_args([*given, "--int8-fp32", "none"]))
    assert none == int8_options(build_parser().parse_args(given)) and none.fp32_roles == ()
    every, _ = cli_int8
    q = load_artifact(every).manifest["int8"]["quantization"]
    assert q["fp32_roles"] == [] and q["quantized"]["MatMul"] == QUANTIZED_MATMULS  # the default: every GEMM
    pruned = tmp_path / "pruned"
    argv = ["prune", built_st.spec, "--stats", stats, "--keep-top", "1", "--tasks", "rte", "--out", pruned]
    code, out, _ = _cli(capsys, *argv, "--precision", "int8", "--max-seq-len", 16, "--int8-fp32", "ffn_in:0", "ffn_out")
    assert code == 0, out
    assert load_artifact(pruned).manifest["int8"]["quantization"]["fp32_roles"] == ["ffn_in:0", "ffn_out"]
    code, _, err = _cli(capsys, "export", built_st.spec, "--out", tmp_path / "x", "--precision", "int8", "--int8-fp32", "ffn")
    assert code == 2 and "--int8-fp32: unknown entry 'ffn'; allowed: attention_qkv" in err
    code, _, err = _cli(capsys, "export", built_st.spec, "--out", tmp_path / "y", "--int8-fp32", "ffn_out")
    assert code == 2 and "--int8-fp32 is for --precision int8 (this is --precision fp32)" in err
