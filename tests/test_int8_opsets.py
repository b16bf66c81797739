"""int8 at every opset `export --opset` accepts for it, and every opset it cannot write refused before any work, with
the range (issue 40 item 3): the per-row rewrite wrote ReduceMin/ReduceMax with their axes as an attribute, which
opset 18 moved to an input, so int8 failed from 18 on; below 13 QuantizeLinear has no per-row scale, and below 11
torch's exporter cannot write the model at all."""

import onnx
import pytest

from fusionserve.errors import FusionServeError
from fusionserve.export.artifact import export_artifact
from fusionserve.serving.model.artifact import load_artifact


@pytest.mark.slow
@pytest.mark.parametrize("opset", [18, 23])
def test_int8_exports_at_the_opsets_past_17(built_st, tmp_path, opset):
    out = tmp_path / "art"
    # one fusion task (rte): the per-row GEMMs of the backbone and the adapters, at a quarter of the graph's size
    manifest = export_artifact(
        built_st.spec, out, precision="int8", opset=opset, max_seq_len=16, progress=False, parity_grid="quick", tasks=["rte"]
    )
    graph = onnx.load(str(load_artifact(out).model_path), load_external_data=False)
    assert manifest["opset"] == opset and {o.domain: o.version for o in graph.opset_import}[""] == opset
    reduces = [n for n in graph.graph.node if n.op_type in ("ReduceMax", "ReduceMin")]
    assert reduces and all(len(n.input) == 2 and [a.name for a in n.attribute] in ([], ["keepdims"]) for n in reduces)


@pytest.mark.parametrize(
    ("precision", "opset", "says"),
    [("int8", 12, "--precision int8 needs --opset 13 to 23"), ("fp32", 10, "--opset must be between 11 and 23, got 10")],
)
def test_an_opset_the_export_cannot_write_is_refused_before_any_work(built_st, tmp_path, precision, opset, says):
    with pytest.raises(FusionServeError, match=says):
        export_artifact(built_st.spec, tmp_path / "art", precision=precision, opset=opset, progress=False)
    assert list(tmp_path.iterdir()) == []
