"""`fusionserve export`: one ONNX graph for every task that matches AdapterHub and the PyTorch model, a complete
manifest with checksums, the fused operators ONNX Runtime promises, fp16 export on CPU, and export -> predict ->
inspect on the command line. Tampered artifacts and failed exports are in test_export_errors.py."""

import hashlib
import importlib
import json
from collections import Counter
from datetime import datetime

import numpy as np
import onnx
import pytest
import torch

from fusionserve.errors import FusionServeError
from fusionserve.export.artifact import export_artifact
from fusionserve.export.build import build_model
from fusionserve.export.spec import load_spec
from fusionserve.export.validate import BATCH_SIZES, TOLERANCES, tolerances
from fusionserve.serving.model.artifact import _REQUIRED, load_artifact
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from fusionserve.serving.private import ORT_OPTIMIZER
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS, TINY, VOCAB
from tests.export_helpers import MAX_SEQ_LEN, OPSET, _cli

# one worker for test_export, test_export_errors and test_cli under xdist, so that conftest's ``exported`` is exported once
# per weight format: test_export checks that its manifest names the spec of this worker's ``built``, which an export
# shared across workers (tests/made_once.py) would not
pytestmark = pytest.mark.xdist_group("exported")

TOL = 1e-4


FUSION_TASKS = [name for name, (kind, *_) in TASKS.items() if kind == "fusion"]
# 3 layers, every one with adapters: per layer one Attention, SkipLayerNormalization after attention, after the
# adapter stack's first LayerNorm and after the FFN, and one BiasGelu; one EmbedLayerNormalization.
FUSED = {"Attention": 3, "SkipLayerNormalization": 9, "EmbedLayerNormalization": 1, "BiasGelu": 3}


@pytest.fixture(scope="module")
def ours(built):
    return build_model(load_spec(built.spec))


@pytest.fixture(scope="module")
def runner(exported) -> OnnxRunner:
    return OnnxRunner(exported.folder, device="cpu")


def _cases():
    yield "single", [TextInput(SENTENCES[0])]
    yield "padded", [TextInput(s) for s in SENTENCES]
    yield "pairs", [TextInput(a, b) for a, b in PAIRS]


def _hf_batch(tok, inputs: list[TextInput]):
    pairs = [i.text_pair for i in inputs] if inputs[0].text_pair is not None else None
    return tok([i.text for i in inputs], pairs, padding=True, return_tensors="pt")


# --- ONNX == AdapterHub == PyTorch ---------------------------------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
def test_onnx_logits_match_adapterhub_and_pytorch(built, ours, runner, task):
    for what, inputs in _cases():
        batch = _hf_batch(built.tokenizer, inputs)
        enc = runner.encoder.encode(inputs)  # the artifact's tokenizer.json gives the HF tokenizer's ids
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            np.testing.assert_array_equal(getattr(enc, key), batch[key].numpy(), err_msg=f"{what}: {key}")
        got, truncated = runner.logits(task, inputs)
        assert truncated == [False] * len(inputs)
        ref = built.reference_logits(task, dict(batch)).numpy()
        with torch.inference_mode():
            pt = ours.classify(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], task=task).numpy()
        assert got.shape == ref.shape == pt.shape == (len(inputs), len(TASKS[task][3]))
        assert np.abs(got - ref).max() <= TOL, f"{task} {what}: ONNX vs AdapterHub {np.abs(got - ref).max():.2e}"
        assert np.abs(got - pt).max() <= TOL, f"{task} {what}: ONNX vs PyTorch {np.abs(got - pt).max():.2e}"
        assert np.abs(ref).max() > 1e-3


@pytest.mark.parametrize("task", FUSION_TASKS)
def test_fusion_activations_match_pytorch(ours, runner, task):
    for what, inputs in _cases():
        enc = runner.encoder.encode(inputs)
        out = runner.run(task, enc, return_fusion_activations=True)
        ids, mask, types = (torch.from_numpy(a) for a in (enc.input_ids, enc.attention_mask, enc.token_type_ids))
        with torch.inference_mode():
            logits, acts = ours.classify(ids, mask, types, task=task, return_fusion_activations=True)
        n_adapters = len(TASKS[task][1])
        assert (
            out.fusion_activations.shape
            == tuple(acts.shape)
            == (len(inputs), TINY["num_hidden_layers"], ids.shape[1], n_adapters)
        )
        diff = np.abs(out.fusion_activations - acts.numpy()).max()
        assert diff <= TOL, f"{task} {what}: fusion activations differ by {diff:.2e}"
        assert np.abs(out.logits - logits.numpy()).max() <= TOL
        # softmax weights over the adapters present in each layer: they sum to one and are not all one-hot
        np.testing.assert_allclose(out.fusion_activations.sum(-1), 1.0, atol=1e-5)
        assert np.ptp(out.fusion_activations) > 0.05


@pytest.mark.parametrize("task", ["alpha_only", "head_only"])
def test_fusion_activations_of_a_task_without_fusion_are_refused(runner, task):
    enc = runner.encoder.encode([TextInput(SENTENCES[0])])
    with pytest.raises(FusionServeError, match=f"task '{task}' has no fusion layer"):
        runner.run(task, enc, return_fusion_activations=True)


# --- the manifest and the graph ------------------------------------------------------------------------------


def test_manifest_is_complete_and_verifies(built, ours, exported):
    folder = exported.folder
    manifest = json.loads((folder / "manifest.json").read_text())
    assert exported.manifest == manifest  # export_artifact returns what it wrote
    for key in (*_REQUIRED, "created_utc", "base_model", "fused_operators", "io"):
        assert key in manifest, f"manifest lacks '{key}'"
    assert (manifest["format"], manifest["format_version"]) == ("fusionserve-artifact", 1)
    assert (manifest["precision"], manifest["opset"], manifest["max_seq_len"]) == ("fp32", OPSET, MAX_SEQ_LEN)
    assert manifest["tokenizer"] == {"file": "tokenizer.json", "pad_token": "[PAD]", "max_length": MAX_SEQ_LEN}
    assert datetime.fromisoformat(manifest["created_utc"]).utcoffset().total_seconds() == 0
    base = {"architecture": "bert", "layers": 3, "hidden_size": 32, "attention_heads": 4, "vocab_size": len(VOCAB)}
    assert manifest["base_model"] == base
    assert manifest["fusion_layers"] == [{"layer": i, "place": "output"} for i in range(3)]  # seq_bn: after the FFN
    graph = onnx.load(str(folder / "model.onnx"))
    assert {o.domain: o.version for o in graph.opset_import}[""] == OPSET
    assert manifest["io"] == {"inputs": [i.name for i in graph.graph.input], "outputs": [o.name for o in graph.graph.output]}
    assert manifest["io"]["outputs"] == ["logits", "fusion_activations"]

    # tasks, in spec order, as the model describes them
    assert manifest["adapters"] == ["alpha", "beta", "gamma"]
    assert manifest["adapters_per_layer"] == [["alpha", "beta", "gamma"], ["alpha", "gamma"], ["alpha", "beta", "gamma"]]
    assert list(manifest["tasks"]) == list(TASKS)
    for name, info in ours.task_infos.items():
        assert manifest["tasks"][name] == {
            "index": ours.task_index[name],
            "kind": info.kind,
            "head": "classification",
            "labels": list(info.labels),
            "adapters": list(info.adapters),
            "adapters_per_layer": [list(layer) for layer in info.adapters_per_layer],
        }
        assert manifest["tasks"][name]["labels"] == TASKS[name][3]
    assert manifest["tasks"]["nli"]["adapters_per_layer"][1] == ["alpha"]  # beta leaves out layer 1

    # every file of the folder, with checksums that verify
    files = manifest["files"]
    assert set(files) == {p.name for p in folder.iterdir()} - {"manifest.json"}
    for name in ("model.onnx", "tokenizer.json"):
        assert files[name] == hashlib.sha256((folder / name).read_bytes()).hexdigest()
    assert load_artifact(folder).tasks["rte"].labels == tuple(TASKS["rte"][3])

    # where it came from: the spec and every checkpoint file
    root = built.spec.parent.resolve()
    sources = manifest["sources"]
    assert sources["spec"] == {"path": str(built.spec.resolve()), "sha256": hashlib.sha256(built.spec.read_bytes()).hexdigest()}
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "model.yaml"}
    assert set(sources["files"]) == on_disk
    config = "adapters/alpha/adapter_config.json"
    assert sources["files"][config] == hashlib.sha256((root / config).read_bytes()).hexdigest()
    assert len(set(sources["files"].values())) == len(on_disk)  # a digest per file, not one repeated

    parity = manifest["parity"]
    assert parity["precision"] == "fp32" and parity["tolerance"] == tolerances("fp32", ("logits", "fusion_activations"))
    assert parity["max_abs_diff"]["logits"] <= TOL and parity["max_abs_diff"]["fusion_activations"] <= TOL
    assert parity["cases"] == len(TASKS) * len(BATCH_SIZES) * 2 + 2  # + a batch mixing every task, per length


def test_fused_operators(exported):
    fused = exported.manifest["fused_operators"]
    assert fused["found"] == FUSED
    assert fused["expected"] == FUSED
    assert fused["summary"].startswith("all fused")
    ops = Counter(node.op_type for node in onnx.load(str(exported.folder / "model.onnx")).graph.node)
    assert {op: ops[op] for op in FUSED} == FUSED
    assert ops["LayerNormalization"] == 0
    assert ops["Softmax"] == 3  # the fusion's, one per adapter layer; attention's softmax is inside Attention


# --- fp16 ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("built", ["safetensors"], indirect=True)
def test_fp16_export_on_cpu(built, runner, tmp_path):
    # rte's random 'dynamic' fusion (full query and key, perturbed far from their init) is very sharp: its
    # fusion weights are the hardest case for fp16 (the adapter path stays fp32, its input does not).
    spec = built.spec
    out = tmp_path / "fp16"
    manifest = export_artifact(spec, out, precision="fp16", max_seq_len=MAX_SEQ_LEN, opset=18, progress=False)
    assert (manifest["precision"], manifest["opset"], manifest["max_seq_len"]) == ("fp16", 18, MAX_SEQ_LEN)
    parity = manifest["parity"]
    assert parity["precision"] == "fp16" and parity["tolerance"] == tolerances("fp16", ("logits", "fusion_activations"))
    assert parity["max_abs_diff"]["logits"] <= TOLERANCES["fp16"]["logits"]
    assert TOLERANCES["fp16"]["fusion_activations"] is None  # recorded only: a sharp fusion magnifies fp16 input
    assert 0 < parity["max_abs_diff"]["fusion_activations"] < 1
    assert manifest["fused_operators"]["found"] == FUSED

    graph = onnx.load(str(out / "model.onnx"))
    assert {o.domain: o.version for o in graph.opset_import}[""] == 18
    weights = Counter()  # element type -> number of weights stored in it
    for t in graph.graph.initializer:
        weights[t.data_type] += int(np.prod(t.dims))
    f16, f32 = weights[onnx.TensorProto.FLOAT16], weights[onnx.TensorProto.FLOAT]
    model = build_model(load_spec(spec))
    backbone = sum(p.numel() for p in model.backbone.model.encoder.parameters())
    weights_of = ("down_w", "down_b", "score_w", "score_b", "out_w", "out_b")
    adapter_path = sum(getattr(blk, w).numel() for blk in model.blocks for w in weights_of if hasattr(blk, w))
    assert f16 >= backbone, f"{f16} weights in fp16, the encoder alone has {backbone}"  # the backbone went fp16
    assert f32 >= adapter_path, f"{f32} weights in fp32, the adapter path has {adapter_path}"  # adapters stayed fp32
    # inputs and outputs keep their types
    assert [i.type.tensor_type.elem_type for i in graph.graph.input] == [onnx.TensorProto.INT64] * 4
    assert [o.type.tensor_type.elem_type for o in graph.graph.output] == [onnx.TensorProto.FLOAT] * 2

    half = OnnxRunner(out, device="cpu")
    assert list(half.labels) == list(TASKS)
    moved = 0.0
    for task in half.labels:
        for what, inputs in _cases():
            lo, _ = half.logits(task, inputs)
            hi, _ = runner.logits(task, inputs)
            assert np.abs(lo - hi).max() <= TOLERANCES["fp16"]["logits"], f"{task} {what}"
            np.testing.assert_array_equal(lo.argmax(-1), hi.argmax(-1), err_msg=f"{task} {what}")
            moved = max(moved, float(np.abs(lo - hi).max()))
    assert moved > 0  # it really ran at reduced precision


# --- the command line ----------------------------------------------------------------------------------------


def test_cli_export_predict_inspect(built_st, tmp_path, capsys):
    art = tmp_path / "artifact"
    code, out, _ = _cli(capsys, "export", built_st.spec, "--out", art)
    assert code == 0
    assert out.startswith(f"wrote {art}: {len(TASKS)} task(s), fp32") and "all fused" in out
    assert load_artifact(art).manifest["max_seq_len"] == 512  # the model's positions; the tokenizer sets no limit

    src = tmp_path / "in.jsonl"
    rows = [{"text": s} for s in SENTENCES] + [{"text": a, "text_pair": b} for a, b in PAIRS]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for task in ("rte", "beta_only"):
        results = []
        for model in (art, built_st.spec):
            code, out, _ = _cli(capsys, "predict", model, "--task", task, "--input", src)
            assert code == 0
            results.append([json.loads(line) for line in out.splitlines()])
        onnx_rows, torch_rows = results
        assert len(onnx_rows) == len(torch_rows) == len(rows)
        for a, b in zip(onnx_rows, torch_rows, strict=True):
            assert a["label"] == b["label"] and list(a["scores"]) == TASKS[task][3]
            np.testing.assert_allclose(a["logits"], b["logits"], atol=TOL, rtol=0)

    code, out, _ = _cli(capsys, "inspect", art)
    assert code == 0
    assert "all fused" in out and "fusion over alpha, beta, gamma" in out and "opset 17" in out
    for task in TASKS:
        assert f"  {task} " in out
    code, out, _ = _cli(capsys, "inspect", art, "--json")
    assert code == 0
    assert json.loads(out) == load_artifact(art).manifest


def test_quick_grid_checks_each_kind_fully_and_every_task_once(built_st, tmp_path, monkeypatch):
    """(Its export also shows the optimizer asked to skip the passes that never match our graphs: tests/test_private_onnxruntime.py
    checks that skipping them leaves the graph as it was.)"""
    optimizer = importlib.import_module(ORT_OPTIMIZER).MODEL_TYPES["bert"][0]
    ran = []

    def spy(name):
        run = getattr(optimizer, name)
        return lambda self, *args: ran.append(name) or run(self, *args)

    for name in ("fuse_rotary_embeddings", "fuse_qordered_mamtul", "fuse_skip_layer_norm", "fuse_skip_simplified_layer_norm"):
        monkeypatch.setattr(optimizer, name, spy(name))
    manifest = export_artifact(built_st.spec, tmp_path / "quick", max_seq_len=64, progress=False, parity_grid="quick")
    assert ran == ["fuse_skip_layer_norm"] and manifest["fused_operators"]["summary"].startswith("all fused")
    kinds = [t["kind"] for t in manifest["tasks"].values()]
    shapes = len([s for s in (5, 37, 128) if s <= 64]) * 3
    assert manifest["parity"]["grid"]["kind"] == "quick"
    mixed = shapes // 3  # a batch of rows of every task at each length
    assert manifest["parity"]["cases"] == len(set(kinds)) * shapes + len(kinds) - len(set(kinds)) + mixed
    with pytest.raises(FusionServeError, match="--parity-grid must be one of full, quick, got 'none'"):
        export_artifact(built_st.spec, tmp_path / "none", progress=False, parity_grid="none")


def test_the_spec_sets_the_default_token_limit(built_st, tmp_path):
    import yaml

    data = yaml.safe_load(built_st.spec.read_text())
    spec = built_st.spec.with_name("model-limit-20.yaml")  # beside the original: its relative paths still hold
    spec.write_text(yaml.safe_dump({**data, "max_seq_len": 20}))
    one = {"progress": False, "parity_grid": "quick", "tasks": ["rte"]}  # one task: the limit is the graph's, not a task's
    assert export_artifact(spec, tmp_path / "a", **one)["max_seq_len"] == 20
    assert export_artifact(spec, tmp_path / "b", max_seq_len=24, **one)["max_seq_len"] == 24
    spec.write_text(yaml.safe_dump({**data, "max_seq_len": "long"}))
    with pytest.raises(FusionServeError, match="max_seq_len = 'long' must be a whole number of tokens"):
        export_artifact(spec, tmp_path / "c", progress=False)
