"""Every backbone x adapter architecture through `fusionserve export`: the fused ONNX Runtime kernels its architecture
allows, the parity gate, a manifest naming the backbone and the graph's own inputs, and the serving runtime (the
artifact's tokenizer.json and model.onnx, no torch) giving AdapterHub's logits on text pairs with padding; fp16 for
every backbone; the command line on every backbone (inspect, predict, score) and on a Houlsby RoBERTa (calibrate,
prune). int8: test_backbones_int8.py; the serving batching path: test_backbones_serving.py."""

import json

import numpy as np
import pytest
import torch

from fusionserve.export.artifact import export_artifact
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.backbone_models import ARCHS, LAYERS, TASKS
from tests.export_helpers import ARCH_MAX_SEQ_LEN, _cli, arch_export

TOL = 1e-4
INPUTS_WITH_TYPES = ["input_ids", "attention_mask", "token_type_ids", "task_id"]


def _expected_fusions(arch: str, adapter_config: str) -> dict[str, int]:
    """What ONNX Runtime fuses: per layer one Attention and BiasGelu, a SkipLayerNormalization after attention and after
    the FFN, one more where seq_bn adapters read LN(f + a); BERT's and DistilBERT's embeddings, not RoBERTa's."""
    embed = "EmbedLayerNormalization" if arch in ("bert", "distilbert") else "LayerNormalization"
    skip = 2 * LAYERS + (LAYERS if adapter_config == "seq_bn" else 0)
    return {embed: 1, "Attention": LAYERS, "SkipLayerNormalization": skip, "BiasGelu": LAYERS}


def _cases():
    yield [TextInput(s) for s in SENTENCES], dict(padding=True)
    yield [TextInput(a, b) for a, b in PAIRS], dict(padding=True)


def _reference(built, task, inputs):
    firsts = [i.text for i in inputs]
    seconds = [i.text_pair for i in inputs] if inputs[0].text_pair is not None else None
    return built.reference_logits(task, dict(built.tokenizer(firsts, seconds, padding=True, return_tensors="pt"))).numpy()


def test_manifest_fused_operators_and_inputs(arch_built, arch_exported):
    m = arch_exported.manifest
    want = _expected_fusions(arch_built.arch, arch_built.adapter_config)
    assert m["fused_operators"]["expected"] == want
    assert all(m["fused_operators"]["found"].get(op, 0) >= n for op, n in want.items()), m["fused_operators"]
    assert m["fused_operators"]["summary"].startswith("all fused")
    assert m["base_model"]["architecture"] == arch_built.arch
    # RoBERTa has one token type and DistilBERT none: their graphs take no token_type_ids
    inputs = INPUTS_WITH_TYPES if arch_built.arch == "bert" else [i for i in INPUTS_WITH_TYPES if i != "token_type_ids"]
    assert m["io"]["inputs"] == inputs and list(m["inputs"]) == inputs
    places = ["output"] if arch_built.adapter_config == "seq_bn" else ["attention", "output"]
    assert m["fusion_layers"] == [{"layer": i, "place": p} for i in range(LAYERS) for p in places]
    assert len(m["adapters_per_layer"]) == len(m["fusion_layers"])
    # the grid (3 batch sizes x 2 lengths) per task, and a batch mixing every task per length
    assert m["parity"]["max_abs_diff"]["logits"] <= TOL and m["parity"]["cases"] == len(TASKS) * 3 * 2 + 2


def test_runtime_matches_adapterhub(arch_built, arch_exported):
    """The serving side needs nothing but the artifact: its tokenizer.json encodes pairs and pads as the base
    model's own tokenizer does, and the graph gives AdapterHub's logits."""
    runner = OnnxRunner(arch_exported.folder, device="cpu")
    worst = {}
    for task in TASKS:
        for inputs, _ in _cases():
            got, truncated = runner.logits(task, inputs)
            worst[task] = max(worst.get(task, 0.0), float(np.abs(got - _reference(arch_built, task, inputs)).max()))
            assert not any(truncated)
    assert max(worst.values()) <= TOL, worst
    acts = runner.run("dyn", runner.encoder.encode(next(_cases())[0]), return_fusion_activations=True).fusion_activations
    assert acts.shape[1] == len(arch_exported.manifest["fusion_layers"])


@pytest.mark.parametrize("arch", ARCHS)
def test_fp16_export_for_every_backbone(arch_models, arch, tmp_path):
    """The task it reads, dyn (a fusion of all three adapters: the backbone, every adapter and a fusion at every site go
    fp16), exported alone: the other tasks' fp16 parity is test_export.py's and test_head_kinds_export.py's."""
    built = arch_models(arch, "double_seq_bn")
    manifest = export_artifact(
        built.spec, tmp_path / "fp16", precision="fp16", max_seq_len=ARCH_MAX_SEQ_LEN, progress=False, tasks=["dyn"]
    )
    assert manifest["precision"] == "fp16" and manifest["fused_operators"]["summary"].startswith("all fused")
    runner = OnnxRunner(tmp_path / "fp16", device="cpu")
    for inputs, _ in _cases():
        got, _ = runner.logits("dyn", inputs)
        assert np.abs(got - _reference(built, "dyn", inputs)).max() <= 5e-2


def test_command_line_on_a_houlsby_roberta(arch_models, tmp_path_factory, tmp_path, capsys):
    """inspect (spec and artifact), predict, calibrate, prune and score on a RoBERTa with Houlsby adapters: six
    fusion layers (after attention and after the FFN of each of 3 layers), pruned with the last one dropped. The
    artifact is ``arch_exported``'s for roberta-double_seq_bn (the same export, made once per run): the command line's
    `export` is test_export.py's and test_backbones_int8.py's."""
    built = arch_models("roberta", "double_seq_bn")
    art = arch_export(tmp_path_factory, built.spec, "roberta", "double_seq_bn")
    code, out, _ = _cli(capsys, "inspect", built.spec)
    assert code == 0 and "roberta, 3 layers" in out and "L1a:alpha+gamma" in out and "after attention and FFN" in out
    code, out, _ = _cli(capsys, "inspect", art)
    assert code == 0 and "base model  roberta, 3 layers" in out and "  L1a: alpha, gamma\n  L1: alpha, gamma\n" in out

    text, pair = PAIRS[1]
    code, out, _ = _cli(capsys, "predict", art, "--task", "dyn", "--text", text, "--text-pair", pair)
    assert code == 0
    ref = _reference(built, "dyn", [TextInput(text, pair)])[0]
    torch.testing.assert_close(torch.tensor(json.loads(out)["logits"]), torch.from_numpy(ref), atol=TOL, rtol=0)

    src = tmp_path / "in.jsonl"
    rows = [{"text": s} for s in SENTENCES] + [{"text": a, "text_pair": b} for a, b in PAIRS]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = tmp_path / "stats.json"
    code, _, err = _cli(capsys, "calibrate", art, "--task", "dyn", "--input", src, "--output", stats)
    assert code == 0, err
    assert len(json.loads(stats.read_text())["tasks"]["dyn"]["mean"]) == 2 * LAYERS
    pruned = tmp_path / "pruned"
    code, out, err = _cli(capsys, "prune", built.spec, "--stats", stats, "--keep-top", "2", "--drop-layers", "-1",
                          "--out", pruned, "--max-seq-len", ARCH_MAX_SEQ_LEN, "--tasks", "dyn")  # fmt: skip
    assert code == 0, err
    assert "  layer 0 attention: " in out and "  layer 2 output: - (fusion dropped)" in out
    manifest = load_artifact(pruned).manifest
    kept = manifest["pruning"]["tasks"]["dyn"]["kept_per_layer"]
    assert len(kept) == 2 * LAYERS and kept[-1] == [] and all(0 < len(k) <= 2 for k in kept[:-1])

    dst = tmp_path / "out.jsonl"
    code, _, err = _cli(capsys, "score", pruned, "--task", "dyn", "--input", src, "--output", dst)
    assert code == 0, err
    assert len(dst.read_text().splitlines()) == len(rows)


def test_command_line_on_every_backbone(arch_built, arch_exported, tmp_path, capsys):
    """inspect (spec and artifact), predict (spec and artifact, a text pair) and score (a file of pairs) on each
    backbone x adapter architecture give its description and AdapterHub's answers."""
    from fusionserve.serving.model.predictions import softmax

    arch, art = arch_built.arch, arch_exported.folder
    houlsby = arch_built.adapter_config == "double_seq_bn"
    code, out, _ = _cli(capsys, "inspect", arch_built.spec)
    assert code == 0 and f"{arch}, 3 layers" in out and ("after attention and FFN" in out) == houlsby
    code, out, _ = _cli(capsys, "inspect", art)
    assert code == 0 and f"base model  {arch}, 3 layers" in out and "fused ops   all fused" in out

    text, pair = PAIRS[2]
    ref = _reference(arch_built, "stat", [TextInput(text, pair)])[0]
    for model in (arch_built.spec, art):  # the PyTorch model, then the ONNX artifact
        code, out, err = _cli(capsys, "predict", model, "--task", "stat", "--text", text, "--text-pair", pair)
        assert code == 0, err
        got = json.loads(out)
        torch.testing.assert_close(torch.tensor(got["logits"]), torch.from_numpy(ref), atol=TOL, rtol=0, msg=str(model))
        assert got["label"] == TASKS["stat"][3][int(ref.argmax())]

    src, dst = tmp_path / "pairs.jsonl", tmp_path / "scored.jsonl"
    src.write_text("".join(json.dumps({"id": i, "a": a, "b": b}) + "\n" for i, (a, b) in enumerate(PAIRS)))
    argv = ["--task", "dyn", "--input", src, "--output", dst, "--text-field", "a", "--pair-field", "b", "--all-scores"]
    code, _, err = _cli(capsys, "score", art, *argv)
    assert code == 0, err
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    want = softmax(_reference(arch_built, "dyn", [TextInput(a, b) for a, b in PAIRS]).astype(np.float64))
    got = np.array([[r[f"score_{label}"] for label in TASKS["dyn"][3]] for r in rows])
    assert [r["id"] for r in rows] == list(range(len(PAIRS))) and np.abs(got - want).max() <= 1e-5  # 6 decimals written
