"""fusionserve == AdapterHub on checkpoints AdapterHub saved (both weight formats), every task kind."""

import pytest
import torch

from fusionserve.export.build import build_model
from fusionserve.export.spec import load_spec
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS

TOL = 1e-4


@pytest.fixture(scope="module")
def ours(built):
    return build_model(load_spec(built.spec))


def _batches(tok):
    yield "single", tok(SENTENCES[:1], return_tensors="pt")
    yield "padded", tok(SENTENCES, padding=True, return_tensors="pt")
    yield "pairs", tok([p[0] for p in PAIRS], [p[1] for p in PAIRS], padding=True, return_tensors="pt")


@pytest.mark.parametrize("task", list(TASKS))
def test_logits_match_adapterhub(built, ours, task):
    for what, batch in _batches(built.tokenizer):
        ref = built.reference_logits(task, dict(batch))
        with torch.no_grad():
            got = ours.classify(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], task=task)
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        assert diff <= TOL, f"{task} {what}: max abs diff {diff:.2e}"
        # the reference must not be trivially equal for every task: heads and adapters differ
        assert ref.abs().max() > 1e-3


def test_tasks_differ(built, ours):
    """Guard against a test that cannot fail: adapters and fusion change the logits of a shared head size."""
    batch = built.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ours.classify(batch["input_ids"], batch["attention_mask"], task="alpha_only")
        h = ours.classify(batch["input_ids"], batch["attention_mask"], task="head_only")
    assert (a - h).abs().max() > 1e-2


def test_fusion_activations_match_adapterhub(built, ours):
    batch = built.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    built.reference_logits("rte", dict(batch))  # sets the active setup, T = 1
    with torch.no_grad():
        out = built.reference(**batch, output_adapter_fusion_attentions=True)
        _, acts = ours.classify(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], task="rte",
                            return_fusion_activations=True)  # fmt: skip
    ref = out.adapter_fusion_attentions["alpha,beta,gamma"]
    assert acts.shape == (len(SENTENCES), 3, batch["input_ids"].shape[1], 3)
    for layer, per_loc in ref.items():
        want = torch.as_tensor(per_loc["output_adapter"])  # (batch, seq, n_present)
        present = [i for i, n in enumerate(TASKS["rte"][1]) if not (n == "beta" and layer == 1)]
        got = acts[:, layer][..., present]
        assert (got - want).abs().max() <= TOL, f"layer {layer}"
    assert torch.all(acts[:, 1, :, 1] == 0)  # beta left out of layer 1
    torch.testing.assert_close(acts.sum(-1), torch.ones_like(acts.sum(-1)))


def test_head_file_with_another_heads_weights_loads_its_own(tmp_path):
    """AdapterHub's save_head("x") also writes the weights of every head whose name starts with "x"."""
    from adapters import BertAdapterModel

    from fusionserve.export.head import load_head
    from tests.adapterhub_models import write_base

    write_base(tmp_path / "base")
    model = BertAdapterModel.from_pretrained(str(tmp_path / "base"))
    model.add_classification_head("x", num_labels=2)
    model.add_classification_head("x_more", num_labels=5)
    model.save_head(str(tmp_path / "head"), "x", use_safetensors=True)
    head = load_head(tmp_path / "head")
    assert head.labels == ("LABEL_0", "LABEL_1")
    w, bias = head.linears[-1]
    torch.testing.assert_close(w, model.heads["x"][4].weight.detach())
    torch.testing.assert_close(bias, model.heads["x"][4].bias.detach())


def test_fusion_file_with_another_fusions_weights_loads_its_own(tmp_path):
    """AdapterHub's save_adapter_fusion("a,b") also writes the weights of every fusion whose name starts with "a,b"
    (here "a,b,c"): the loader keeps the fusion the config names and leaves the others out."""
    from adapters import BertAdapterModel, SeqBnConfig
    from adapters.composition import Fuse

    from fusionserve.export.checkpoint import load_fusion
    from tests.adapterhub_models import write_base

    write_base(tmp_path / "base")
    model = BertAdapterModel.from_pretrained(str(tmp_path / "base"))
    for name in ("a", "b", "c"):
        model.add_adapter(name, config=SeqBnConfig(reduction_factor=4))
    model.add_adapter_fusion(Fuse("a", "b"))
    model.add_adapter_fusion(Fuse("a", "b", "c"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapter_fusion_layer" in name:
                p.add_(torch.randn(p.shape) * 0.3)
    model.save_adapter_fusion(str(tmp_path / "fusion"), "a,b", use_safetensors=True)
    fusion = load_fusion(tmp_path / "fusion")
    assert fusion.name == "a,b" and fusion.adapter_names == ("a", "b")
    for site, got in fusion.sites.items():
        want = model.bert.encoder.layer[site.layer].output.adapter_fusion_layer["a,b"]
        torch.testing.assert_close(got.query_w, want.query.weight.detach())
        torch.testing.assert_close(got.key_b, want.key.bias.detach())
        torch.testing.assert_close(got.value_w, want.value.weight.detach())
    assert len(fusion.sites) == 3
