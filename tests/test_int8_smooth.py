"""SmoothQuant before int8 (``export/int8/smooth.py``): the smoothed fp32 graph answers as the original, the int8 gate runs
on the graph quantized from it (mixed batches included), static QDQ is gated alike, a calibration file that is empty
or not texts is refused before anything is exported, and ``inspect`` shows the smoothing."""

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fusionserve.export.build import build_model
from fusionserve.export.int8.calibration import calibration_inputs
from fusionserve.export.int8.quantize import ROLES, Int8Options, backbone_roles, quantizable
from fusionserve.export.int8.smooth import SMOOTH_TOLERANCE, SmoothingError, check_smoothed, smooth_graph
from fusionserve.export.spec import load_spec
from fusionserve.export.validate import BATCH_SIZES, grid_inputs, mixed_cases
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.runtime import make_session
from fusionserve.serving.model.tokenize import Encoder
from tests.adapterhub_models import TASKS
from tests.export_helpers import _cli
from tests.runtime_helpers import MAX_SEQ_LEN
from tests.score_helpers import _texts, _write

LAYERS = 3


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    rows = [{"text": t} for t in _texts(24, seed=5)] + [{"text": "a pair", "text_pair": "of texts"}]
    return _write(tmp_path_factory.mktemp("cal") / "calibration.jsonl", rows)


def _outputs_over_grid(model, max_seq_len):
    """The int8 gate's inputs: one task over the grid, then batches mixing every task row by row."""
    cases = [{**f, "task_id": np.array([0])} for _, _, f in grid_inputs(model.backbone.vocab_size, max_seq_len)]
    return cases + [{**f, "task_id": ids} for ids, (_, _, f) in mixed_cases(model, max_seq_len)]


def test_smoothed_fp32_graph_equals_the_original(built_st, artifacts, calibration_file, tmp_path):
    src = artifacts.fp32 / "model.onnx"
    model = build_model(load_spec(built_st.spec))
    graph = onnx.load(str(src))
    roles = backbone_roles(graph)
    nodes = [n for n in quantizable(graph, Int8Options(fp32_roles=())) if n in roles]  # every backbone GEMM
    encoder = Encoder.from_file(artifacts.fp32 / "tokenizer.json", MAX_SEQ_LEN)
    calibration = calibration_inputs(model, MAX_SEQ_LEN, str(calibration_file), encoder)
    assert calibration.rows == 25 and calibration.source == str(calibration_file)
    dst = tmp_path / "smoothed.onnx"
    record = smooth_graph(src, dst, nodes, 0.5, calibration)
    # per layer the attention output's inverse goes into the V columns; QKV, FFN in and FFN out get a Mul
    assert (record["gemms"], record["inverse_in_v_columns"], record["inverse_as_mul"]) == (4 * LAYERS, LAYERS, 3 * LAYERS)
    smoothed = onnx.load(str(dst))
    muls = [n for n in smoothed.graph.node if n.op_type == "Mul" and n.name.endswith("_smooth")]
    assert len(muls) == 3 * LAYERS
    before = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in smoothed.graph.initializer}
    nodes_by_name = {n.name: n for n in graph.graph.node}
    changed = [n for n in nodes if not np.array_equal(before[nodes_by_name[n].input[1]], after[nodes_by_name[n].input[1]])]
    assert changed == nodes and record["largest_scale"] > 1.5  # the weights really moved

    original, session = make_session(src, threads=1, device="cpu"), make_session(dst, threads=1, device="cpu")
    cases = _outputs_over_grid(model, MAX_SEQ_LEN)
    assert 0 < check_smoothed(session, original, cases) <= SMOOTH_TOLERANCE

    # a wrong inverse (one channel of one Mul off by 1%) is caught, naming the output
    inv = next(t for t in smoothed.graph.initializer if t.name == muls[0].input[1])
    value = numpy_helper.to_array(inv).copy()
    value[0] *= 1.01
    inv.CopyFrom(numpy_helper.from_array(value, inv.name))
    onnx.save(smoothed, str(tmp_path / "wrong.onnx"))
    wrong = make_session(tmp_path / "wrong.onnx", threads=1, device="cpu")
    with pytest.raises(SmoothingError, match=r"smoothed fp32 graph departs from the original; nothing quantized:\n  logits"):
        check_smoothed(wrong, original, cases)


def test_cli_int8_smoothed_every_gemm_is_gated_and_inspect_shows_it(built_st, calibration_file, tmp_path, capsys):
    art = tmp_path / "int8"
    argv = ["export", built_st.spec, "--out", art, "--precision", "int8", "--max-seq-len", MAX_SEQ_LEN]
    code, out, err = _cli(capsys, *argv, "--int8-fp32", "none", "--int8-smooth", "0.5", "--calibration", calibration_file)
    assert code == 0, err
    manifest = load_artifact(art).manifest
    record = manifest["int8"]
    smooth, gate, q = record["smoothing"], record["gate"], record["quantization"]
    assert smooth["alpha"] == 0.5 and smooth["calibration"] == {"source": str(calibration_file), "rows": 25, "batches": 2}
    assert 0 < smooth["fp32_max_abs_diff"] <= SMOOTH_TOLERANCE
    assert q["options"]["smooth_alpha"] == 0.5 and q["options"]["calibration"] == str(calibration_file)
    # every task over the grid, then a batch of 8 rows cycling through the 7 tasks: the int8 gate of the smoothed graph
    assert gate["rows"] == len(TASKS) * sum(BATCH_SIZES) + 8
    assert gate["label_agreement"] >= gate["thresholds"]["min_label_agreement"]
    # smoothed by default: QKV of each layer, with a Mul (gemm_roles.DEFAULT_SMOOTH_ROLES)
    assert (smooth["gemms"], smooth["inverse_in_v_columns"], smooth["inverse_as_mul"]) == (LAYERS, 0, LAYERS)
    assert q["quantized"] == {"MatMul": 4 * LAYERS, "Attention": LAYERS} and q["kept_fp32"]["smoothing Mul"]["count"] == 3
    ops = Counter(n.op_type for n in onnx.load(str(art / "model.onnx")).graph.node)
    assert ops["QAttention"] == LAYERS  # quantized from the smoothed graph: QKV per tensor, every MatMul per row
    assert ops["MatMulInteger"] == 0 and ops["MatMulIntegerToFloat"] == 4 * LAYERS

    code, out, _ = _cli(capsys, "inspect", art)
    assert code == 0
    assert f"label agreement {gate['label_agreement']:.2%} (min 85%)" in out
    assert f"int8 smooth alpha 0.5 over {LAYERS} GEMMs (inverse in V columns 0, as a Mul {LAYERS}" in out
    assert f"calibrated on 25 rows of {calibration_file}; smoothed fp32 vs fp32 max |diff| " in out


def test_static_qdq_is_calibrated_and_gated(built_st, calibration_file, tmp_path, capsys):
    art = tmp_path / "static"
    argv = ["export", built_st.spec, "--out", art, "--precision", "int8", "--max-seq-len", MAX_SEQ_LEN]
    code, _, err = _cli(capsys, *argv, "--int8-method", "static", "--calibration", calibration_file)
    assert code == 0, err
    record = load_artifact(art).manifest["int8"]
    q = record["quantization"]
    assert q["method"].startswith("onnxruntime.quantization.quantize_static (QDQ")
    assert q["calibration"]["rows"] == 25 and q["quantized"]["Attention"] == 0  # no int8 Attention in QDQ
    assert record["gate"]["label_agreement"] >= record["gate"]["thresholds"]["min_label_agreement"]
    ops = Counter(n.op_type for n in onnx.load(str(art / "model.onnx")).graph.node)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0 and ops["Attention"] == LAYERS


@pytest.mark.parametrize(
    "content, why",
    [
        ("", "no rows (an empty file)"),
        ("\n\n", "no rows (an empty file)"),
        ('{"text": "fine"}\n[1, 2, 3]\n', ":2: each line must be an object with a string 'text'"),
        ('{"txt": "a typo"}\n', ":1: each line must be an object with a string 'text' (and optionally 'text_pair'), got keys"),
        ('{"text": "ok"}\nnot json\n', ":2: not JSON"),
        (
            '{"text": ["a", "list"]}\n',
            ":1: each line must be an object with a string 'text' (and optionally 'text_pair'), got 'text' of type list",
        ),
    ],
)
def test_a_bad_calibration_file_is_refused_before_exporting(built_st, tmp_path, capsys, content, why):
    bad = tmp_path / "cal.jsonl"
    bad.write_text(content)
    out = tmp_path / "artifact"
    argv = ["export", built_st.spec, "--out", out, "--precision", "int8", "--int8-smooth", "0.5", "--calibration", bad]
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and f"fusionserve: error: --calibration {bad}" in err and why in err, err
    assert not out.exists() and err.count("\n") == 1  # one line, nothing exported


def test_int8_flags_are_checked(built_st, tmp_path, capsys):
    spec = built_st.spec
    code, _, err = _cli(capsys, "export", spec, "--out", tmp_path / "a", "--precision", "int8", "--int8-smooth", "1.5")
    assert code == 2 and "--int8-smooth: expected a number in [0, 1] or 'none', got '1.5'" in err
    code, _, err = _cli(capsys, "export", spec, "--out", tmp_path / "b", "--calibration", tmp_path / "x.jsonl")
    assert code == 2 and "--calibration is for --precision int8 (this is --precision fp32)" in err
    with pytest.raises(ValueError, match="smooth_roles: unknown role 'ffn'; allowed: " + ", ".join(ROLES)):
        Int8Options(smooth_roles=("ffn",))
    with pytest.raises(ValueError, match="method: unknown 'qdq'; allowed: dynamic, static"):
        Int8Options(method="qdq")
    with pytest.raises(ValueError, match="activations: unknown 'column'; allowed: row, tensor"):
        Int8Options(activations="column")
    code, _, err = _cli(capsys, "export", spec, "--out", tmp_path / "c", "--int8-activations", "tensor")
    assert code == 2 and "--int8-activations is for --precision int8 (this is --precision fp32)" in err
