"""Every head kind AdapterHub trains, read from the folders the real ``adapters`` library saved, and computed as it computes
them: regression (a classification head with one label), multiple choice (one logit per (context, choice) pair),
tagging and extractive QA (every token's final state), fused and over a single adapter, on every backbone (BERT,
RoBERTa, XLM-RoBERTa, DistilBERT) with either adapter architecture (Pfeiffer, Houlsby). A head kind fusionserve does not
serve, and a field a kind's head does not take, are refused in one line naming them."""

import json
import shutil

import numpy as np
import pytest
import torch

from fusionserve.errors import CheckpointError
from fusionserve.export.build import build_model
from fusionserve.export.head import load_head
from fusionserve.export.spec import load_spec
from tests.adapterhub_models import build
from tests.export_helpers import _cli
from tests.head_kinds import HEADS, TAGS, batches, kind, task

TOL = 1e-4
# what each kind reads back as: (labels, num_choices, linear layers)
READS = {
    "score": (("score",), None, 2),
    "choose": (("choice",), 3, 2),
    "tags": (tuple(TAGS), None, 1),
    "span": (("start", "end"), None, 1),
}


@pytest.fixture(scope="module")
def ours(arch_heads):
    return build_model(load_spec(arch_heads.spec))


def test_every_head_kind_reads_as_adapterhub_saved_it(bert_heads):
    """Kind, labels, choices and every linear layer's weights, as the library's own head modules hold them."""
    root = bert_heads.spec.parent
    for name, (kind_, _, _) in HEADS.items():
        head = load_head(root / "heads" / name)
        labels, choices, layers = READS[name]
        assert (head.kind, head.labels, head.num_choices, len(head.linears)) == (kind_, labels, choices, layers), name
        assert head.level == ("token" if kind_ in ("tagging", "question_answering") else "sequence")
        modules = [m for m in bert_heads.reference.heads[name] if isinstance(m, torch.nn.Linear)]
        for (w, b), module in zip(head.linears, modules, strict=True):
            torch.testing.assert_close(w, module.weight.detach())
            torch.testing.assert_close(b, module.bias.detach())
    assert load_head(root / "heads" / bert_heads.classification).kind == "classification"


def _reference_model(tmp_path):
    built = build(tmp_path, safetensors=True, seed=6)
    return built, built.reference


def test_a_head_kind_not_served_is_refused_in_one_line_naming_it(tmp_path, capsys):
    """AdapterHub's dependency-parsing and multi-label heads, saved by the library: the loader and `fusionserve export`
    both name the kind and the kinds served, in one line."""
    built, model = _reference_model(tmp_path / "m")
    model.add_dependency_parsing_head("parse", num_labels=4)
    model.add_classification_head("many", num_labels=3, multilabel=True)
    for name, head_type in (("parse", "dependency_parsing"), ("many", "multilabel_classification")):
        model.save_head(str(tmp_path / name), name)
        with pytest.raises(CheckpointError) as err:
            load_head(tmp_path / name)
        message = str(err.value)
        assert f"field 'config.head_type' = '{head_type}' is not supported" in message, message
        assert "supported: classification, multiple_choice, tagging, question_answering" in message
        assert "\n" not in message
    spec = built.spec.read_text().replace("heads/rte", str(tmp_path / "parse"))
    (tmp_path / "m/parse.yaml").write_text(spec)
    code, _, err = _cli(capsys, "export", tmp_path / "m/parse.yaml", "--out", tmp_path / "out")
    errors = [line for line in err.splitlines() if "error" in line]  # the rest is the progress line
    assert code == 2 and len(errors) == 1 and errors[0].startswith("fusionserve: error: "), err
    assert "'dependency_parsing' is not supported; supported: classification, multiple_choice" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "head, field, value, says",
    [
        ("tags", "use_pooler", True, "unknown config field(s) ['use_pooler'] for a tagging head"),
        ("span", "bias", False, "unknown config field(s) ['bias'] for a question_answering head"),
        ("choose", "num_labels", 1, "unknown config field(s) ['num_labels'] for a multiple_choice head"),
        ("span", "num_labels", 3, "field 'config.num_labels' = 3: a question_answering head has 2 (start, end)"),
        ("choose", "num_choices", 1, "field 'config.num_choices' = 1 must be an integer >= 2"),
        ("tags", "num_labels", 4, "weight 'heads.1.weight' has shape (5, 32), expected (4, 32)"),
    ],
)
def test_a_field_a_kind_does_not_take_or_a_bad_value_is_refused_by_name(bert_heads, tmp_path, head, field, value, says):
    folder = tmp_path / head
    shutil.copytree(bert_heads.spec.parent / "heads" / head, folder)
    path = folder / "head_config.json"
    config = json.loads(path.read_text())
    config["config"][field] = value
    if field == "num_labels" and head == "tags":
        config["config"]["label2id"] = {t: i for i, t in enumerate(TAGS[:4])}
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_head(folder)
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def _compare(arch_heads, ours, name, worst):
    """fusionserve's model against AdapterHub's on task ``name`` (a token-level head over each row's real tokens)."""
    if kind(name) == "multiple_choice":
        rows, ref = arch_heads.choices(name)
        with torch.no_grad():
            got = ours.classify(rows["input_ids"], rows["attention_mask"], rows.get("token_type_ids"), task=name)
        assert got.shape == (ref.size, 1)
        worst[name] = float(np.abs(got.numpy().reshape(ref.shape) - ref).max())
        return
    for what, batch in batches(arch_heads.tokenizer):
        assert (batch["attention_mask"] == 0).any()  # padded
        ref = arch_heads.outputs(name, batch)
        with torch.no_grad():
            got = ours.classify(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"), task=name).numpy()
        assert got.shape == ref.shape, (name, what)
        real = batch["attention_mask"].bool().numpy()
        diff = np.abs(got - ref)[real] if got.ndim == 3 else np.abs(got - ref)
        worst[f"{name} {what}"] = float(diff.max())
        assert np.abs(ref).max() > 1e-2  # a head that answers something


def test_every_head_kind_matches_adapterhub_fused_and_single(arch_built, arch_heads, ours):
    """Each backbone x adapter architecture (the arch_built parameters) x head kind x (fused, single adapter)."""
    worst: dict[str, float] = {}
    for name in HEADS:
        for how in ("fused", "single"):
            _compare(arch_heads, ours, task(name, how), worst)
    assert len(worst) == 14 and max(worst.values()) <= TOL, worst
    # guard against a comparison that cannot fail: the fused and the single-adapter task of a head differ
    batch = batches(arch_heads.tokenizer)[0][1]
    with torch.no_grad():
        fused, single = (
            ours.classify(batch["input_ids"], batch["attention_mask"], task=f"tags_{h}") for h in ("fused", "single")
        )
    assert (fused - single).abs().max() > 1e-2


def test_the_model_knows_each_task_s_head_and_level(ours):
    heads = {name: (info.head, info.level, info.num_choices) for name, info in ours.infos.items()}
    assert heads["label_fused"] == ("classification", "sequence", None)
    assert heads["score_single"] == ("regression", "sequence", None)
    assert heads["choose_fused"] == ("multiple_choice", "sequence", 3)
    assert heads["tags_fused"] == ("tagging", "token", None)
    assert heads["span_single"] == ("question_answering", "token", None)
    assert ours.outputs == ("logits", "fusion_activations", "token_logits")
    assert (ours.max_labels, ours.token_width) == (3, len(TAGS))  # logits: rte's 3 labels; token_logits: the 5 tags
