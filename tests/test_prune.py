"""prune: pruning an adapter the fusion never uses changes nothing (checked against AdapterHub); a fusion pruned to one
adapter is that adapter's model; per-layer pruning matches the plain equations and ONNX matches PyTorch; bad options
are refused clearly; --eval puts accuracy and latency side by side. The statistics it prunes with come from
calibrate (the ``stats`` fixture in conftest.py; calibrate itself is tested in test_calibrate_evaluate.py)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fusionserve.export.build import build_model
from fusionserve.export.checkpoint import load_adapter, load_fusion
from fusionserve.export.predict import TorchRunner
from fusionserve.export.prune import PruneError, PruneRule, dropped, plan, prune_artifact
from fusionserve.export.spec import load_spec
from fusionserve.scoring.calibrate import calibrate
from fusionserve.scoring.inputs import read_labelled_jsonl
from fusionserve.serving.model.activations import CalibrationError, load_stats, stats_document
from fusionserve.serving.model.artifact import load_artifact
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS, TINY, write_base
from tests.prune_helpers import MAX_SEQ_LEN, _cli, _jsonl, _texts
from tests.reference import plain_fusion
from tests.runtime_helpers import MAX_SEQ_LEN as RUNTIME_MAX_SEQ_LEN

CASES = [[TextInput(s) for s in SENTENCES], [TextInput(a, b) for a, b in PAIRS]]


def _logits(model, task: str, inputs: list[TextInput], runner: TorchRunner) -> np.ndarray:
    enc = runner.encoder.encode(inputs)
    ids, mask, types = (torch.from_numpy(a) for a in (enc.input_ids, enc.attention_mask, enc.token_type_ids))
    with torch.inference_mode():
        return model.classify(ids, mask, types, task=task).numpy()


# --- prune: exactness ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def silenced(tmp_path_factory):
    """A model saved by AdapterHub whose fusion gives adapter 'gamma' zero weight on every token of every layer:
    its query weight is zero, so every token asks b_q, and gamma's output is the constant that scores -30000
    against it. Returns (spec, AdapterHub reference model, tokenizer)."""
    from adapters import BertAdapterModel, SeqBnConfig
    from adapters.composition import Fuse
    from transformers import BertTokenizerFast

    root = tmp_path_factory.mktemp("silenced")
    write_base(root / "base", seed=7)
    model = BertAdapterModel.from_pretrained(str(root / "base"))
    for name in ("alpha", "beta", "gamma"):
        model.add_adapter(name, config=SeqBnConfig(reduction_factor=4))
    model.add_adapter_fusion(Fuse("alpha", "beta", "gamma"), config="dynamic")
    model.add_classification_head("t", num_labels=3)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapters." in name or "adapter_fusion_layer" in name or name.startswith("heads."):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        for layer in model.bert.encoder.layer:
            fusion = layer.output.adapter_fusion_layer["alpha,beta,gamma"]
            fusion.query.weight.zero_()
            u = fusion.key.weight.T @ fusion.query.bias  # score_n = u . z_n + (the same for every n)
            gamma = layer.output.adapters["gamma"]
            gamma.adapter_up.weight.zero_()
            gamma.adapter_up.bias.copy_(-3e4 * u / u.dot(u))
    model.eval()
    spec = {"base_model": "base", "adapters": {}, "tasks": {"t": {"fusion": "fusions/t", "head": "heads/t"}}}
    for sub in ("adapters", "heads", "fusions"):
        (root / sub).mkdir()
    for name in ("alpha", "beta", "gamma"):
        model.save_adapter(str(root / "adapters" / name), name)
        spec["adapters"][name] = f"adapters/{name}"
    model.save_adapter_fusion(str(root / "fusions" / "t"), "alpha,beta,gamma")
    model.save_head(str(root / "heads" / "t"), "t")
    (root / "model.yaml").write_text(yaml.safe_dump(spec))
    model.set_active_adapters(Fuse("alpha", "beta", "gamma"))
    model.active_head = "t"
    return root / "model.yaml", model, BertTokenizerFast.from_pretrained(str(root / "base"))


def test_pruning_an_adapter_with_zero_activation_changes_nothing(silenced, tmp_path):
    spec, reference, tok = silenced
    runner = TorchRunner(spec)
    src = _texts(tmp_path / "in.jsonl")
    result, _ = calibrate(runner, ["t"], read_labelled_jsonl(src, False))
    assert result["t"]["mean_over_layers"]["gamma"] == 0.0 and min(result["t"]["mean_over_layers"].values()) == 0.0
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(stats_document(result, str(spec), src, 0)))

    art = tmp_path / "pruned"
    manifest, plans = prune_artifact(spec, stats, PruneRule(min_activation=0.01), art, max_seq_len=MAX_SEQ_LEN, progress=False)
    assert plans["t"].kept_per_layer == (("alpha", "beta"),) * TINY["num_hidden_layers"]
    assert manifest["adapters_per_layer"] == [["alpha", "beta"]] * TINY["num_hidden_layers"]  # gamma costs nothing now
    assert manifest["pruning"]["tasks"]["t"]["dropped_everywhere"] == ["gamma"]
    assert "mean weight 0.0000 < 0.01" in manifest["pruning"]["tasks"]["t"]["dropped_per_layer"][0]["gamma"]

    pruned = OnnxRunner(art, device="cpu")
    for inputs in CASES:
        batch = tok(
            [i.text for i in inputs],
            [i.text_pair for i in inputs] if inputs[0].text_pair else None,
            padding=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            ref = reference(**batch).logits.numpy()
        before = _logits(runner.model, "t", inputs, runner)
        after = pruned.logits("t", inputs)[0]
        assert np.abs(ref).max() > 1e-2
        assert np.abs(before - ref).max() < 1e-4  # the unpruned model is AdapterHub's
        assert np.abs(after - before).max() < 1e-5, f"pruning changed the logits by {np.abs(after - before).max():.2e}"


@pytest.mark.parametrize("task", ["custom", "flat"])  # fusions without a value matrix (V = identity)
def test_a_fusion_pruned_to_one_adapter_is_that_adapters_model(built_st, stats, tmp_path, task):
    doc = load_stats(stats)
    best = max(doc["tasks"][task]["mean_over_layers"].items(), key=lambda kv: kv[1])[0]
    art = tmp_path / "pruned"
    prune_artifact(built_st.spec, stats, PruneRule(keep_top=1), art, tasks=[task], max_seq_len=MAX_SEQ_LEN, progress=False)
    # the same head on the kept adapter alone: a single-adapter task
    data = yaml.safe_load(built_st.spec.read_text())
    data["tasks"] = {"single": {"adapter": best, "head": data["tasks"][task]["head"]}}
    single_spec = built_st.spec.parent / f"single-{task}.yaml"
    single_spec.write_text(yaml.safe_dump(data))
    single = TorchRunner(single_spec)
    pruned = OnnxRunner(art, device="cpu")
    assert pruned.task(task).adapters == (best,) and list(pruned.artifact.tasks) == [task]  # --tasks: only that one
    for inputs in CASES:
        got, want = pruned.logits(task, inputs)[0], single.logits("single", inputs)[0]
        assert np.abs(want).max() > 1e-2
        assert np.abs(got - want).max() < 1e-5, f"{task} pruned to {best}: {np.abs(got - want).max():.2e}"


def test_per_layer_pruning_keeps_different_counts_and_matches_pytorch_and_the_equations(built_st, tmp_path):
    spec = load_spec(built_st.spec)
    full = build_model(spec)
    # hand-made statistics: in layer 0 all three adapters clear 0.2, in layer 2 only alpha does (layer 1 has no beta)
    means = [[0.4, 0.35, 0.25], [0.7, 0.0, 0.3], [0.8, 0.1, 0.1]]
    stats = {"format": "fusionserve-calibration", "format_version": 1, "tasks": {"rte": {
        "adapters": ["alpha", "beta", "gamma"], "adapters_per_layer": [list(a) for a in full.infos["rte"].adapters_per_layer],
        "tokens": 10, "examples": 2, "mean": means, "std": [[0.1] * 3] * 3,
        "mean_over_layers": {"alpha": 0.63, "beta": 0.225, "gamma": 0.217}}}}  # fmt: skip
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(stats))
    rule = PruneRule(min_activation=0.2, per_layer=True)
    plans = plan(load_stats(path), full.task_infos, rule, 3)
    assert plans["rte"].kept_per_layer == (("alpha", "beta", "gamma"), ("alpha", "gamma"), ("alpha",))
    art = tmp_path / "pruned"
    manifest, _ = prune_artifact(built_st.spec, path, rule, art, max_seq_len=MAX_SEQ_LEN, progress=False)
    assert manifest["tasks"]["rte"]["adapters_per_layer"] == [["alpha", "beta", "gamma"], ["alpha", "gamma"], ["alpha"]]

    model = build_model(spec, dropped(plans, full.task_infos))
    runner = OnnxRunner(art, device="cpu")
    for task in TASKS:  # the pruned task changes; every other task is exactly what it was
        for inputs in CASES:
            enc = runner.encoder.encode(inputs)
            ids, mask, types = (torch.from_numpy(a) for a in (enc.input_ids, enc.attention_mask, enc.token_type_ids))
            with torch.inference_mode():
                pt = model.classify(ids, mask, types, task=task).numpy()
                before = full.classify(ids, mask, types, task=task).numpy()
            got = runner.run(task, enc).logits
            assert np.abs(got - pt).max() < 1e-4, f"{task}: ONNX vs PyTorch {np.abs(got - pt).max():.2e}"
            assert (np.abs(pt - before).max() > 1e-3) == (task == "rte")

    # each pruned layer is the plain fusion equations over the kept adapters only
    adapters = {n: load_adapter(p) for n, p in spec.adapters.items()}
    fusion = load_fusion(spec.tasks["rte"].fusion)
    gen = torch.Generator().manual_seed(0)
    task_id = torch.tensor([model.task_index["rte"]])
    for i, kept in enumerate(plans["rte"].kept_per_layer):
        site = model.sites[i]
        block, ln = model.blocks[site.index], model.backbone.ffn_output(site.layer)[1]
        f, a = torch.randn(2, 5, TINY["hidden_size"], generator=gen), torch.randn(2, 5, TINY["hidden_size"], generator=gen)
        with torch.no_grad():
            out, s = block(f, torch.zeros(TINY["hidden_size"]), a, ln, task_id)
            want, s_ref = plain_fusion(f, a, ln, [adapters[n].sites[site] for n in kept], "relu", fusion.sites[site])
        assert torch.allclose(out, want, atol=1e-5), f"layer {i}: {(out - want).abs().max():.2e}"
        columns = [model.stacks[i].index(n) for n in kept]
        assert torch.allclose(s[..., columns], s_ref, atol=1e-5)


def test_drop_layers_removes_the_fusion_there_and_the_manifest_says_why(built_st, stats, tmp_path, capsys):
    art = tmp_path / "pruned"
    code, out, err = _cli(capsys, "prune", built_st.spec, "--stats", stats, "--keep-top", "2", "--drop-layers", "-1",
                          "--out", art, "--max-seq-len", MAX_SEQ_LEN)  # fmt: skip
    assert code == 0, err
    assert "rule: keep top 2 in every layer (ranked by the mean over layers); fusion dropped in layer(s) 2" in out
    assert "  layer 2: - (fusion dropped)" in out and f"wrote {art}" in out
    manifest = load_artifact(art).manifest
    for task in ("rte", "nli", "custom", "flat"):
        record = manifest["pruning"]["tasks"][task]
        assert record["kept_per_layer"][2] == [] and manifest["tasks"][task]["adapters_per_layer"][2] == []
        assert all(why == "layer 2 dropped (--drop-layers)" for why in record["dropped_per_layer"][2].values())
        assert len(record["kept"]) <= 2
    runner = OnnxRunner(art, device="cpu")
    acts = runner.run("rte", runner.encoder.encode(CASES[0]), return_fusion_activations=True).fusion_activations
    assert np.all(acts[:, 2] == 0) and np.all(acts[:, 0].sum(-1) > 0.99)
    code, out, _ = _cli(capsys, "inspect", art)
    assert "pruned      keep top 2" in out and "rte L2: - (fusion dropped)" in out


# --- prune: errors ---------------------------------------------------------------------------------------------


def _edited_stats(stats: Path, tmp_path: Path, edit) -> Path:
    doc = json.loads(stats.read_text())
    edit(doc)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def _as_adapter_task(doc):
    doc["tasks"] = {"alpha_only": doc["tasks"]["rte"]}


def _unknown_task(doc):
    doc["tasks"] = {"sentiment": doc["tasks"]["rte"]}


def _other_model(doc):
    doc["tasks"]["rte"]["adapters"] = ["alpha", "beta"]
    doc["tasks"]["rte"]["mean"] = [row[:2] for row in doc["tasks"]["rte"]["mean"]]


@pytest.mark.parametrize(
    "args, edit, says",
    [
        (["--keep-top", "4"], None, "--keep-top 4: task 'rte' fuses only 3 adapters (alpha, beta, gamma)"),
        (["--keep-top", "0"], None, "--keep-top must be at least 1, got 0"),
        (["--min-activation", "1.5"], None, "--min-activation is a softmax weight between 0 and 1, got 1.5"),
        (["--keep-top", "1", "--drop-layers", "3"], None, "--drop-layers 3: the base model has 3 layers (0 to 2, or -1 for the last)"),
        (["--keep-top", "1", "--drop-layers", "0", "1", "2"], None, "leave task 'rte' no adapter in any layer"),
        (["--keep-top", "1"], _as_adapter_task, "task 'alpha_only' has no fusion layer (adapter task); only fusions are pruned"),
        (["--keep-top", "1"], _unknown_task, "the stats describe task(s) sentiment, none of which this model serves"),
        (["--keep-top", "1"], _other_model, "calibrate the unpruned model this spec builds"),
        (["--keep-top", "1", "--tasks", "nope"], None, "unknown task 'nope'; known tasks: rte"),
        (["--keep-top", "1", "--tasks", "rte", "rte"], None, "task(s) ['rte'] named more than once"),
    ],
)  # fmt: skip
def test_bad_prune_options_are_refused_and_write_nothing(built_st, stats, tmp_path, capsys, args, edit, says):
    path = _edited_stats(stats, tmp_path, edit) if edit else stats
    out = tmp_path / "out"
    code, _, err = _cli(capsys, "prune", built_st.spec, "--stats", path, "--out", out, *args)
    assert code == 2 and says in err, err
    assert not out.exists()


def test_an_out_that_holds_the_stats_is_refused_even_with_force(built_st, stats, tmp_path, capsys):
    folder = tmp_path / "work"
    folder.mkdir()
    kept = folder / "stats.json"
    kept.write_bytes(stats.read_bytes())
    code, _, err = _cli(capsys, "prune", built_st.spec, "--stats", kept, "--keep-top", "1", "--out", folder, "--force")
    assert code == 2 and f"--out {folder} holds --stats {kept}; the export would replace it" in err, err
    assert kept.read_bytes() == stats.read_bytes()


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "stats file not found"),
        ("{", "cannot read stats file"),
        ('{"format": "other"}', "not a stats file written by `fusionserve calibrate`"),
        ('{"format": "fusionserve-calibration", "format_version": 1, "tasks": {"rte": {"mean": 1}}}', "tasks.rte is malformed"),
    ],
)
def test_bad_stats_files_are_refused(tmp_path, content, says):
    path = tmp_path / "stats.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CalibrationError, match=says.replace("(", r"\(")):
        load_stats(path)


def test_prune_rule_needs_exactly_one_criterion():
    with pytest.raises(PruneError, match="exactly one of --keep-top K and --min-activation X"):
        PruneRule()
    with pytest.raises(PruneError, match="exactly one of"):
        PruneRule(keep_top=1, min_activation=0.1)


# --- prune --eval ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prune_with_eval_prints_accuracy_and_latency_side_by_side(built_st, stats, artifact, tmp_path, capsys):
    """The unpruned baseline is conftest's ``artifact`` (this spec exported at runtime_helpers.MAX_SEQ_LEN, made once
    per run); the pruned model is exported at the same token limit, so that only pruning differs."""
    labels = TASKS["nli"][3]
    src = _jsonl(tmp_path / "l.jsonl", [{"text": s, "label": labels[k % 2]} for k, s in enumerate(SENTENCES * 2)])
    assert load_artifact(artifact).manifest["max_seq_len"] == RUNTIME_MAX_SEQ_LEN
    code, out, err = _cli(capsys, "prune", built_st.spec, "--stats", stats, "--keep-top", "1", "--out", tmp_path / "p",
                          "--max-seq-len", RUNTIME_MAX_SEQ_LEN, "--eval", src, "--eval-task", "nli", "--baseline", artifact)  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(f"nli on {src} (10 examples"))
    assert lines[head + 2].split()[0] == "unpruned" and lines[head + 3].split()[0] == "pruned"
    assert "of the accuracy at" in lines[head + 4]
    code, _, err = _cli(capsys, "prune", built_st.spec, "--stats", stats, "--keep-top", "1", "--out", tmp_path / "q",
                        "--eval", src)  # fmt: skip
    assert code == 2 and "--eval needs --eval-task: the stats cover 4 tasks (rte, nli, custom, flat)" in err
    assert not (tmp_path / "q").exists()
