"""`fusionserve export`: one ONNX graph for every task that matches AdapterHub and the PyTorch model, a complete
manifest with checksums, the fused operators ONNX Runtime promises, artifacts that refuse to load once changed,
and exports that fail without leaving anything behind."""

import hashlib
import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import yaml

from fusionserve.errors import FusionServeError, SpecError
from fusionserve.export.artifact import export_artifact
from fusionserve.export.model import build_model
from fusionserve.export.spec import load_spec
from fusionserve.export.validate import BATCH_SIZES, TOLERANCES, ParityError
from fusionserve.serving.artifact import _REQUIRED, ArtifactError, load_artifact
from fusionserve.serving.cli import main
from fusionserve.serving.predictions import TextInput
from fusionserve.serving.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS, TINY, VOCAB

TOL = 1e-4
MAX_SEQ_LEN = 64  # the parity grid then runs sequences 5 and 37
OPSET = 17
FUSION_TASKS = [name for name, (kind, *_) in TASKS.items() if kind == "fusion"]
# 3 layers, every one with adapters: per layer one Attention, SkipLayerNormalization after attention, after the
# adapter stack's first LayerNorm and after the FFN, and one BiasGelu; one EmbedLayerNormalization.
FUSED = {"Attention": 3, "SkipLayerNormalization": 9, "EmbedLayerNormalization": 1, "BiasGelu": 3}


@dataclass(frozen=True)
class Exported:
    folder: Path
    manifest: dict[str, Any]  # what export_artifact returned


@pytest.fixture(scope="module")
def exported(built, tmp_path_factory) -> Exported:
    """The tiny model exported once per weight format (fp32, opset 17, 64 tokens)."""
    folder = tmp_path_factory.mktemp("export") / "artifact"
    manifest = export_artifact(built.spec, folder, max_seq_len=MAX_SEQ_LEN, opset=OPSET, progress=False)
    return Exported(folder.resolve(), manifest)


@pytest.fixture(scope="module")
def ours(built):
    return build_model(load_spec(built.spec))


@pytest.fixture(scope="module")
def runner(exported) -> OnnxRunner:
    return OnnxRunner(exported.folder, prefer_gpu=False)


def _cases():
    yield "single", [TextInput(SENTENCES[0])]
    yield "padded", [TextInput(s) for s in SENTENCES]
    yield "pairs", [TextInput(a, b) for a, b in PAIRS]


def _hf_batch(tok, inputs: list[TextInput]):
    pairs = [i.text_pair for i in inputs] if inputs[0].text_pair is not None else None
    return tok([i.text for i in inputs], pairs, padding=True, return_tensors="pt")


def _write_spec(built, path: Path, drop: tuple[str, ...] = (), edit=None) -> Path:
    """A copy of the build's spec with absolute folders, written to ``path``; ``drop`` removes tasks."""
    data = yaml.safe_load(built.spec.read_text())
    root = built.spec.parent
    data["base_model"] = str(root / data["base_model"])
    data["adapters"] = {n: str(root / p) for n, p in data["adapters"].items()}
    tasks = {}
    for name, body in data["tasks"].items():
        if name not in drop:
            tasks[name] = {k: (v if k == "adapter" else str(root / v)) for k, v in body.items()}
    data["tasks"] = tasks
    if edit is not None:
        edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cli(capsys, *argv):
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


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
    assert manifest["base_model"] == {"layers": 3, "hidden_size": 32, "attention_heads": 4, "vocab_size": len(VOCAB)}
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
    assert parity["precision"] == "fp32" and parity["tolerance"] == TOLERANCES["fp32"]
    assert parity["max_abs_diff"]["logits"] <= TOL and parity["max_abs_diff"]["fusion_activations"] <= TOL
    assert parity["cases"] == len(TASKS) * len(BATCH_SIZES) * 2


def test_fused_operators(exported):
    fused = exported.manifest["fused_operators"]
    assert fused["found"] == FUSED
    assert fused["expected"] == FUSED
    assert fused["summary"].startswith("all fused")
    ops = Counter(node.op_type for node in onnx.load(str(exported.folder / "model.onnx")).graph.node)
    assert {op: ops[op] for op in FUSED} == FUSED
    assert ops["LayerNormalization"] == 0
    assert ops["Softmax"] == 3  # the fusion's, one per adapter layer; attention's softmax is inside Attention


# --- tampered artifacts --------------------------------------------------------------------------------------


def _edit_manifest(edit):
    def apply(folder: Path) -> None:
        path = folder / "manifest.json"
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))

    return apply


def _change_model(folder: Path) -> None:
    path = folder / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# case -> (tamper, file the message names, what it says)
TAMPER = {
    "model_changed": (_change_model, "model.onnx", "checksum differs from the manifest"),
    "tokenizer_deleted": (lambda f: (f / "tokenizer.json").unlink(), "", "tokenizer.json is missing"),
    "manifest_not_json": (lambda f: (f / "manifest.json").write_text("{not json"), "manifest.json", "not valid JSON"),
    "wrong_format": (_edit_manifest(lambda m: m.update(format="onnx")), "manifest.json", "'format' must be"),
    "missing_field": (_edit_manifest(lambda m: m.pop("parity")), "manifest.json", "missing field(s) ['parity']"),
    "format_version": (
        _edit_manifest(lambda m: m.update(format_version=99)),
        "manifest.json",
        "format_version 99 is not supported",
    ),
}


@pytest.mark.parametrize("case", list(TAMPER))
def test_tampered_artifact_is_refused(exported, tmp_path, capsys, case):
    tamper, file, says = TAMPER[case]
    folder = tmp_path / "artifact"
    shutil.copytree(exported.folder, folder)
    folder = folder.resolve()
    OnnxRunner(folder, prefer_gpu=False)  # the copy itself loads
    tamper(folder)
    named = str(folder / file) if file else str(folder)
    with pytest.raises(ArtifactError) as exc:
        OnnxRunner(folder, prefer_gpu=False)
    assert named in str(exc.value) and says in str(exc.value)
    code, out, err = _cli(capsys, "predict", folder, "--task", "rte", "--text", "hi")
    assert code == 2 and out == ""
    assert err.startswith("fusionserve: error: ") and named in err and says in err
    assert "Traceback" not in err


def test_folder_without_manifest_is_refused(exported, tmp_path, capsys):
    folder = tmp_path / "artifact"
    shutil.copytree(exported.folder, folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        OnnxRunner(folder, prefer_gpu=False)
    code, out, err = _cli(capsys, "predict", folder, "--task", "rte", "--text", "hi")
    assert code == 2 and out == ""
    assert f"{folder} is a folder without manifest.json" in err


# --- failed exports leave nothing ----------------------------------------------------------------------------


def test_parity_failure_raises_with_every_output_and_writes_nothing(built_st, tmp_path, monkeypatch):
    monkeypatch.setitem(TOLERANCES, "fp32", {"logits": 0.0, "fusion_activations": 0.0})
    out = tmp_path / "artifact"
    with pytest.raises(ParityError) as exc:
        export_artifact(built_st.spec, out, max_seq_len=8, progress=False)
    message = str(exc.value)
    for output in ("logits", "fusion_activations"):
        assert f"  {output}: max |diff| " in message and "(tolerance 0) at task " in message
    assert "no artifact written" in message
    assert not out.exists()
    assert list(tmp_path.glob(".artifact.*")) == []
    assert list(tmp_path.iterdir()) == []


def test_existing_out_needs_force(built_st, tmp_path):
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(FusionServeError, match="exists and is not empty; pass --force"):
        export_artifact(built_st.spec, out, progress=False)
    assert (out / "mine.txt").read_text() == "keep me"
    manifest = export_artifact(built_st.spec, out, max_seq_len=8, force=True, progress=False)
    assert not (out / "mine.txt").exists()
    assert load_artifact(out).manifest == manifest and manifest["max_seq_len"] == 8
    assert list(tmp_path.iterdir()) == [out]  # no temporary folder left beside it


def test_existing_file_as_out_needs_force(built_st, tmp_path):
    out = tmp_path / "artifact"
    out.write_text("a file")
    with pytest.raises(FusionServeError, match="--force"):
        export_artifact(built_st.spec, out, progress=False)
    assert out.read_text() == "a file"


@pytest.mark.parametrize(
    "option, says",
    [
        ({"precision": "int8"}, ["--precision", "'int8'", "fp32, fp16"]),
        ({"opset": 3}, ["--opset", "got 3"]),
        ({"max_seq_len": 4}, ["--max-seq-len", "got 4", "512"]),
        ({"max_seq_len": 100_000}, ["--max-seq-len", "got 100000"]),
    ],
    ids=["precision", "opset", "max_seq_len_small", "max_seq_len_large"],
)
def test_bad_options_are_refused(built_st, tmp_path, option, says):
    with pytest.raises(FusionServeError) as exc:
        export_artifact(built_st.spec, tmp_path / "artifact", progress=False, **option)
    for part in says:
        assert part in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def _missing_adapter_folder(data: dict) -> None:
    data["adapters"]["alpha"] = data["adapters"]["alpha"] + "_gone"


def _fusion_names_unknown_adapter(data: dict) -> None:
    del data["adapters"]["beta"]
    del data["tasks"]["beta_only"]


@pytest.mark.parametrize(
    "edit, says",
    [
        (_missing_adapter_folder, ["adapters.alpha", "alpha_gone", "is not a folder"]),
        (_fusion_names_unknown_adapter, ["fusion of task 'rte'", "['beta']", "spec lacks"]),
    ],
    ids=["missing_folder", "fusion_names_unknown_adapter"],
)
def test_spec_errors_surface_and_write_nothing(built_st, tmp_path, capsys, edit, says):
    spec = _write_spec(built_st, tmp_path / "bad.yaml", edit=edit)
    out = tmp_path / "artifact"
    with pytest.raises(SpecError) as exc:
        export_artifact(spec, out, progress=False)
    for part in says:
        assert part in str(exc.value)
    code, _, err = _cli(capsys, "export", spec, "--out", out)
    assert code == 2 and says[0] in err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]


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
    assert parity["precision"] == "fp16" and parity["tolerance"] == TOLERANCES["fp16"]
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
    backbone = sum(p.numel() for p in model.bert.encoder.parameters())
    weights_of = ("down_w", "down_b", "score_w", "score_b", "out_w", "out_b")
    adapter_path = sum(getattr(blk, w).numel() for blk in model.blocks for w in weights_of if hasattr(blk, w))
    assert f16 >= backbone, f"{f16} weights in fp16, the encoder alone has {backbone}"  # the backbone went fp16
    assert f32 >= adapter_path, f"{f32} weights in fp32, the adapter path has {adapter_path}"  # adapters stayed fp32
    # inputs and outputs keep their types
    assert [i.type.tensor_type.elem_type for i in graph.graph.input] == [onnx.TensorProto.INT64] * 4
    assert [o.type.tensor_type.elem_type for o in graph.graph.output] == [onnx.TensorProto.FLOAT] * 2

    half = OnnxRunner(out, prefer_gpu=False)
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


# --- serving imports no torch --------------------------------------------------------------------------------


def test_serving_imports_no_torch():
    code = (
        "import json, sys\n"
        "import fusionserve.serving.cli, fusionserve.serving.runtime, fusionserve.serving.artifact\n"
        "import fusionserve.serving.tokenize, fusionserve.serving.predictions\n"
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers', 'onnxruntime', 'tokenizers')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"torch": False, "transformers": False, "onnxruntime": True, "tokenizers": True}


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
