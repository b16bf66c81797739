"""The private parts of ONNX Runtime fusionserve relies on (serving/private.py: its transformer optimizer, the fence's
patch of one of its passes, the per-row A scale of its integer GEMM), checked against the installed package: each test
fails when an upgrade of ONNX Runtime breaks what fusionserve relies on, and says which part. Ray's, Serve's and
HAProxy's parts: tests/test_private.py."""

import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path

import numpy as np

from fusionserve.serving import private

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_onnxruntime_is_the_one_checked():
    """pyproject.toml admits only the ONNX Runtime release its parts below were checked on."""
    assert importlib.metadata.version("onnxruntime") == private.CHECKED_ON["onnxruntime"]
    major, minor, _ = private.CHECKED_ON["onnxruntime"].split(".")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert pyproject.count(f'"onnxruntime>={major}.{minor},<{major}.{int(minor) + 1}"') == 3  # export, serve, batch


def test_onnxruntimes_optimizer_takes_what_the_exporter_passes():
    """The BERT fusions' tool: its entry point and the calls export/onnx_export.py makes on what it returns (the
    fusions themselves are checked by every export's fused-operator counts: tests/test_export.py)."""
    optimizer = importlib.import_module(private.ORT_OPTIMIZER)
    params = inspect.signature(optimizer.optimize_model).parameters
    assert {"input", "model_type", "num_heads", "hidden_size", "opt_level"} <= set(params)
    from onnxruntime.transformers.onnx_model import OnnxModel

    fp16 = inspect.signature(OnnxModel.convert_float_to_float16).parameters  # the options go through **kwargs
    assert any(p.kind is p.VAR_KEYWORD for p in fp16.values())  # keep_io_types, op_block_list, node_block_list
    assert "use_external_data_format" in inspect.signature(OnnxModel.save_model_to_file).parameters
    from fusionserve.export.backbone import ARCHITECTURES  # each backbone's model type is one the tool knows

    types = {a.optimizer_model_type for a in ARCHITECTURES.values()}
    assert types <= set(optimizer.MODEL_TYPES)
    for kind in types:  # the model class it returns for that type counts its fusions
        assert callable(optimizer.MODEL_TYPES[kind][0].get_fused_operator_statistics)


def _add_then(norm: str) -> object:
    """Add(a, b) -> ``norm`` (LayerNormalization, or SimplifiedLayerNormalization: RMSNorm) over two (batch, seq, 4)
    inputs: what the SkipLayerNormalization passes fuse, and nothing else."""
    from onnx import TensorProto, helper, numpy_helper

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "seq", 4]) for n in ("a", "b", "y")]
    weights = [numpy_helper.from_array(np.full(4, v, np.float32), n) for n, v in (("gamma", 1.5), ("beta", 0.5))]
    norm_inputs = ["sum", "gamma", "beta"] if norm == "LayerNormalization" else ["sum", "gamma"]
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
        helper.make_node(norm, norm_inputs, ["y"], name="norm", axis=-1, epsilon=1e-5),
    ]
    graph = helper.make_graph(nodes, "g", io[:2], io[2:], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_onnxruntimes_optimizer_skips_the_passes_the_exporter_turns_off_and_writes_the_same_graph(monkeypatch):
    """export/onnx_export.py's FusionOptions (IDLE_PASSES off) and ``skip_simplified_norms_where_present``: the optimizer
    runs neither idle pass, nor the SkipSimplifiedLayerNormalization pass on a graph without SimplifiedLayerNormalization
    (its shape inference: the cost it is skipped for), but runs that pass on a graph with one; and it writes what it
    writes with every pass. An upgrade that renamed an option, or the pass, fails here (the export would be slower)."""
    from fusionserve.export.onnx_export import fusion_options

    tool = importlib.import_module(private.ORT_OPTIMIZER)
    cls = tool.MODEL_TYPES["bert"][0]
    ran = []

    def spy(name: str) -> object:
        run = getattr(cls, name)
        return lambda self, *args: ran.append(name) or run(self, *args)

    for name in ("fuse_rotary_embeddings", "fuse_qordered_mamtul", "fuse_skip_layer_norm", "fuse_skip_simplified_layer_norm"):
        monkeypatch.setattr(cls, name, spy(name))
    spied = cls.fuse_skip_simplified_layer_norm
    for norm, fused in (("LayerNormalization", "SkipLayerNormalization"), ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")):  # fmt: skip
        ran.clear()
        every = tool.optimize_model(_add_then(norm), model_type="bert", num_heads=1, hidden_size=4, opt_level=0).model
        assert len(ran) == 4
        ran.clear()
        with private.skip_simplified_norms_where_present(tool, "bert"):
            assert cls.fuse_skip_simplified_layer_norm is not spied
            with private.skip_simplified_norms_where_present(tool, "bert"):  # a second export meanwhile: one wrap
                assert cls.fuse_skip_simplified_layer_norm.__wrapped__ is spied
            options = fusion_options(tool, "bert")
            lean = tool.optimize_model(_add_then(norm), "bert", 1, 4, optimization_options=options, opt_level=0).model
        assert cls.fuse_skip_simplified_layer_norm is spied  # put back
        where = ["fuse_skip_simplified_layer_norm"] if norm == "SimplifiedLayerNormalization" else []
        assert ran == ["fuse_skip_layer_norm", *where], norm
        assert [n.op_type for n in lean.graph.node] == [fused]
        assert lean.SerializeToString() == every.SerializeToString()


def test_every_shape_inference_of_onnxruntimes_optimizer_is_its_own():
    """``skip_simplified_norms_where_present`` leaves out a pass's shape inference: safe only while every pass that reads
    one makes its own of the graph as it is then (``update=True``) instead of reading the one before it."""
    folder = Path(importlib.import_module(private.ORT_OPTIMIZER).__file__).parent
    calls = [
        (p.name, c)
        for p in sorted(folder.glob("*.py"))
        for c in re.findall(r"(?<!def )infer_runtime_shape\(([^)]*)\)", p.read_text())
    ]
    assert len(calls) >= 6  # the optimizer's passes that ask for one (fusion_skiplayernorm.py, onnx_model.py, ...)
    assert [(name, c) for name, c in calls if "update=True" not in c] == [], "a pass reads a shape inference it did not make"


def test_onnxruntimes_integer_gemm_takes_one_a_scale_per_row():
    """MatMulIntegerToFloat with a (rows, 1) A scale scales each row by its own (export/int8/rowwise.py's rows): with
    one scale for all rows, rows 1 and 2 would be 10x and 100x off."""
    import onnxruntime as ort
    from onnx import TensorProto, numpy_helper
    from onnx import helper as oh

    domain, op = private.ROW_SCALE_GEMM
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [250, 0, 9, 1]], dtype=np.uint8)
    b = np.array([[1, -2], [3, 4], [-5, 6], [7, -8]], dtype=np.int8)
    a_scale = np.array([[0.5], [0.05], [0.005]], dtype=np.float32)
    b_scale = np.array([0.25, 2.0], dtype=np.float32)
    graph = oh.make_graph(
        [oh.make_node(op, ["a", "b", "a_scale", "b_scale"], ["y"], domain=domain)],
        "row_scale",
        [oh.make_tensor_value_info("a", TensorProto.UINT8, [3, 4]),
         oh.make_tensor_value_info("a_scale", TensorProto.FLOAT, [3, 1])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(b_scale, "b_scale")],
    )  # fmt: skip
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid(domain, 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"a": a, "a_scale": a_scale})
    want = a.astype(np.float64) @ b.astype(np.float64) * a_scale * b_scale
    np.testing.assert_allclose(y, want, rtol=1e-6)
