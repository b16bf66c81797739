"""Per-row int8 activations (``export/int8/rowwise.py``): the rewritten MatMul answers as the fp32 one within int8's error,
a row's answer does not depend on the other rows of its batch (an outlier token costs only its own row), an all-zero
row stays zero, and the export quantizes the backbone's GEMMs and the adapters' down-projections that way (each
adapter GEMM's output as numpy computes per-row int8 from the fp32 graph's weight) and gates them, mixed batches
included."""

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from fusionserve.cli.main import build_parser
from fusionserve.cli.model_commands import int8_options
from fusionserve.export.build import build_model
from fusionserve.export.int8.gemm_roles import ROW_ROLES
from fusionserve.export.int8.quantize import DEFAULT_OPTIONS, Int8Options, adapter_gemms, backbone_roles
from fusionserve.export.int8.rowwise import quantize_rows, weight_int8, zero_point_rows
from fusionserve.export.spec import load_spec
from fusionserve.export.validate import BATCH_SIZES, count_cases
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import make_session
from tests.adapterhub_models import TASKS
from tests.export_helpers import _cli, default_int8
from tests.runtime_helpers import MAX_SEQ_LEN

# one worker for both int8 modules under xdist, so that they read one default int8 export (export_helpers.default_int8)
pytestmark = pytest.mark.xdist_group("int8_default")

K, N = 48, 20
LAYERS = 3


def _matmul_graph(tmp_path, w: np.ndarray, bias: np.ndarray, quantize: str | None) -> object:
    """A session of ``Y = X W + b`` (X (batch, seq, K)): fp32 (None), per-row ("row") or ONNX Runtime's per-tensor
    dynamic quantization ("tensor")."""
    nodes = [oh.make_node("MatMul", ["X", "W"], ["XW"], name="gemm"), oh.make_node("Add", ["XW", "b"], ["Y"], name="bias")]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", K])],
        [oh.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", N])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(bias, "b")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / f"{quantize or 'fp32'}.onnx"
    if quantize == "row":
        assert quantize_rows(model, ["gemm"]) == ["gemm_int8"]
        onnx.checker.check_model(model)
    onnx.save(model, str(path))
    if quantize == "tensor":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(path, tmp_path / "tensor-q.onnx", per_channel=True, weight_type=QuantType.QInt8)
        path = tmp_path / "tensor-q.onnx"
    return make_session(path, threads=1, device="cpu")


@pytest.fixture(scope="module")
def gemm(tmp_path_factory):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((K, N)) * 0.2).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    tmp = tmp_path_factory.mktemp("rowwise")
    return {q: _matmul_graph(tmp, w, bias, q) for q in (None, "row", "tensor")}


def _inputs(batch: int, seq: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((batch, seq, K)).astype(np.float32)
    x[:, 0, :3] *= 40  # a [CLS]-like token whose few channels are far larger than the rest
    return x


def test_per_row_matmul_answers_as_fp32_within_int8_error(gemm):
    x = _inputs(4, 9, seed=0)
    want = gemm[None].run(None, {"X": x})[0]
    got = gemm["row"].run(None, {"X": x})[0]
    tensor = gemm["tensor"].run(None, {"X": x})[0]
    assert got.shape == want.shape == (4, 9, N)
    err = np.abs(got - want).max(axis=-1)  # (batch, seq): each row's largest error
    assert err.max() < 0.02 * np.abs(want).max()
    # the rows without the outlier token: per-row scales keep them far closer than one scale per tensor does
    rest = (slice(None), slice(1, None))
    assert np.abs(got - want)[rest].mean() * 5 < np.abs(tensor - want)[rest].mean()


def test_a_rows_answer_does_not_depend_on_its_batch(gemm):
    x = _inputs(3, 7, seed=1)
    whole = gemm["row"].run(None, {"X": x})[0]
    for i in range(3):
        alone = gemm["row"].run(None, {"X": x[i : i + 1]})[0]
        np.testing.assert_allclose(alone[0], whole[i], rtol=0, atol=1e-5)
    # a padded batch (zero rows) and an all-zero input: finite, and zero rows give the bias alone
    zeros = np.zeros((2, 5, K), dtype=np.float32)
    out = gemm["row"].run(None, {"X": zeros})[0]
    bias = gemm[None].run(None, {"X": zeros})[0]
    np.testing.assert_allclose(out, bias, rtol=0, atol=1e-6)


def test_zero_point_rows_cancel_the_weight_column_sums_in_int8():
    """The rows appended to the int8 weight sum, per column, to minus its column sum (so that the row zero points,
    appended to the input, subtract ``z * column sum`` inside the integer GEMM), each entry within int8."""
    w = np.random.default_rng(4).standard_normal((300, 7)).astype(np.float32)
    w[:, 0] = np.abs(w[:, 0])  # a column of one sign: its sum is the largest (about 300 * 127 / 3)
    wq, _ = weight_int8(w)
    extra = zero_point_rows(wq)
    assert extra.dtype == np.int8 and np.abs(extra).max() <= 127
    np.testing.assert_array_equal(extra.astype(np.int64).sum(0), -wq.astype(np.int64).sum(0))
    assert len(extra) == int(np.ceil(np.abs(wq.astype(np.int64).sum(0)).max() / 127))  # as few rows as int8 allows


def test_quantize_rows_refuses_what_it_cannot_rewrite():
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["X", "Y"], ["Z"], name="two_inputs")],
        "g",
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("X", "Y")],
        [oh.make_tensor_value_info("Z", TensorProto.FLOAT, None)],
    )
    with pytest.raises(ValueError, match="two_inputs: per-row int8 takes a MatMul with a stored weight"):
        quantize_rows(oh.make_model(graph), ["two_inputs"])
    with pytest.raises(ValueError, match="no node named missing"):
        quantize_rows(oh.make_model(graph), ["missing"])


def test_export_quantizes_backbone_and_adapter_gemms_per_row_and_gates_it(
    built_st, artifacts, tmp_path_factory, tmp_path, capsys, monkeypatch, caplog
):
    # `export --int8-fp32 none --int8-activations row` asks for exactly the default options: the default export (the one
    # test_int8.py checks too, exported once per process) is that export
    given = ["export", str(built_st.spec), "--out", str(tmp_path / "int8"), "--precision", "int8"]
    asked = int8_options(build_parser().parse_args([*given, "--int8-fp32", "none", "--int8-activations", "row"]))
    assert asked == DEFAULT_OPTIONS and asked.activations == "row" and asked.fp32_roles == ()
    art, _ = default_int8(built_st.spec, MAX_SEQ_LEN, tmp_path_factory)
    record = load_artifact(art).manifest["int8"]
    assert record["quantization"]["options"]["activations"] == "row"
    assert "one scale and zero point per row" in record["quantization"]["activations"]
    graph = onnx.load(str(art / "model.onnx"))
    ops = Counter(n.op_type for n in graph.graph.node)
    fp32 = onnx.load(str(artifacts.fp32 / "model.onnx"))
    adapters = adapter_gemms(fp32)  # the adapters' stacked down-projection, one per adapter site
    assert len(adapters) == LAYERS
    # per layer: attention output, both FFN GEMMs and the adapters' down-projection per row; QKV stays ONNX Runtime's
    # QAttention (per tensor); no GEMM is left to ONNX Runtime's per-tensor DynamicQuantizeMatMul (the adapters' were)
    assert ops["MatMulIntegerToFloat"] == len(ROW_ROLES) * LAYERS + len(adapters)
    assert ops["QAttention"] == LAYERS and ops["DynamicQuantizeMatMul"] == 0
    fp32_roles = backbone_roles(fp32)
    assert {r for _, r in fp32_roles.values()} - set(ROW_ROLES) == {"attention_qkv"}
    _adapter_gemms_match_numpy(fp32, graph, adapters, art)
    gate = record["gate"]  # over the grid for every task and the batches mixing every task row by row
    model = build_model(load_spec(built_st.spec))
    assert gate["cases"] == count_cases(model, MAX_SEQ_LEN) and gate["rows"] == len(TASKS) * sum(BATCH_SIZES) + 8
    assert gate["label_agreement"] >= Int8Options().gate.min_label_agreement
    code, out, _ = _cli(capsys, "inspect", art)
    assert (
        code == 0
        and f"activations: uint8, asymmetric, one scale and zero point per row (token) computed at run time in {len(ROW_ROLES) * LAYERS} backbone GEMMs"
        in out
        and f"and {len(adapters)} adapter-path GEMMs" in out
    )
    _warned_on_a_cpu_without_vnni(art, artifacts, tmp_path, monkeypatch, caplog)


def _per_row_int8(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy's per-row int8 of ``x`` (rows, K) @ ``w`` (K, N): each row's asymmetric uint8 scale and zero point over
    its range (0 included), the weight symmetric int8 with one scale a column, the product in integers."""
    hi, lo = np.maximum(x.max(1), 0), np.minimum(x.min(1), 0)
    s = np.maximum((hi - lo) / 255, 1e-10).astype(np.float32)
    z = np.round(-lo / s)
    xq = np.clip(np.round(x / s[:, None]) + z[:, None], 0, 255)
    ws = np.abs(w).max(0) / 127
    ws = np.where(ws > 0, ws, 1)  # an all-zero column (a padded adapter slot) stays zero
    wq = np.clip(np.round(w / ws), -127, 127)
    return ((xq - z[:, None]) @ wq) * s[:, None] * ws


def _adapter_gemms_match_numpy(fp32: onnx.ModelProto, int8: onnx.ModelProto, adapters: set[str], art) -> None:
    """Each adapter GEMM of the int8 graph, fed the real activations of a padded batch, answers as numpy's per-row int8
    of its input with the fp32 graph's weight."""
    import onnxruntime as ort

    from fusionserve.serving.model.runtime import OnnxRunner

    weights = {t.name: numpy_helper.to_array(t) for t in fp32.graph.initializer}
    nodes = {n.name: n for n in fp32.graph.node if n.name in adapters}
    names = [t for n in nodes.values() for t in (n.input[0], n.output[0])]
    int8.graph.output.extend(oh.make_empty_tensor_value_info(t) for t in names)
    session = ort.InferenceSession(int8.SerializeToString(), providers=["CPUExecutionProvider"])
    runner = OnnxRunner(art, threads=1, device="cpu")
    enc = runner.encoder.encode([TextInput("a short one"), TextInput("the movie was great and the plot is not boring " * 3)])
    wanted = {i.name for i in session.get_inputs()}
    feeds = {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.token_type_ids}
    feeds = {k: v for k, v in {**feeds, "task_id": np.array([0], np.int64)}.items() if k in wanted}
    got = dict(zip(names, session.run(names, feeds), strict=True))
    for name, n in nodes.items():
        x, y = got[n.input[0]], got[n.output[0]]
        want = _per_row_int8(x.reshape(-1, x.shape[-1]), weights[n.input[1]]).reshape(y.shape)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=name)
        exact = x.reshape(-1, x.shape[-1]) @ weights[n.input[1]]  # and it is int8's answer, not fp32's
        assert np.abs(y.reshape(exact.shape) - exact).max() > 1e-5, name


def _warned_on_a_cpu_without_vnni(art, artifacts, tmp_path, monkeypatch, caplog) -> None:
    """ONNX Runtime's uint8 x int8 kernels for AVX2 sum pairs of products in 16 bits: the per-row graph, checked on a
    VNNI CPU at export, may answer otherwise there. A server that loads it on such a CPU says so, once, naming it."""
    from fusionserve.serving.model import cpu_flags
    from fusionserve.serving.model.runtime import OnnxRunner

    avx2, vnni = tmp_path / "avx2", tmp_path / "vnni"
    avx2.write_text("flags\t\t: fpu sse avx2 fma\n")
    vnni.write_text("flags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    manifest = load_artifact(art).manifest
    warning = cpu_flags.int8_risk(manifest, "cpu", avx2)
    assert warning and "saturate" in warning and "--int8-activations tensor" in warning
    assert cpu_flags.int8_risk(manifest, "cpu", vnni) is None and cpu_flags.int8_risk(manifest, "cuda", avx2) is None
    assert cpu_flags.int8_risk(load_artifact(artifacts.fp32).manifest, "cpu", avx2) is None
    for flags, warned in ((avx2, True), (vnni, False)):
        monkeypatch.setattr(cpu_flags, "CPUINFO", flags)
        caplog.clear()
        with caplog.at_level("WARNING", logger="fusionserve"):
            OnnxRunner(art, threads=1, device="cpu")
        said = [r.getMessage() for r in caplog.records if r.name == "fusionserve"]
        assert said == ([f"fusionserve: {art}: {warning}"] if warned else []), said
