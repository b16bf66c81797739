"""fusionserve == AdapterHub on checkpoints it saved, for every backbone (BERT, RoBERTa, XLM-RoBERTa, DistilBERT) x
adapter architecture (seq_bn, double_seq_bn) x task kind (fusion 'dynamic', 'static', single adapter, head only),
with text pairs and padding; the fusion weights at every site (after the FFN, and after the attention block for
Houlsby adapters) match AdapterHub's too."""

import numpy as np
import pytest
import torch

from fusionserve.export.build import build_model
from fusionserve.export.checkpoint import Site
from fusionserve.export.spec import load_spec
from tests.adapterhub_models import PAIRS, SENTENCES
from tests.backbone_models import LAYERS, TASKS

TOL = 1e-4
# AdapterHub's names for the two places, in its fusion-attention output
PLACE_KEYS = {"attention": "mh_adapter", "output": "output_adapter"}


@pytest.fixture(scope="module")
def ours(arch_built):
    return build_model(load_spec(arch_built.spec))


def _batches(tok):
    yield "padded", tok(SENTENCES, padding=True, return_tensors="pt")
    yield "pairs", tok([p[0] for p in PAIRS], [p[1] for p in PAIRS], padding=True, return_tensors="pt")


def test_logits_match_adapterhub(arch_built, ours):
    worst = {}
    for task in TASKS:
        for what, batch in _batches(arch_built.tokenizer):
            assert (batch["attention_mask"] == 0).any()  # padded
            ref = arch_built.reference_logits(task, dict(batch))
            with torch.no_grad():
                got = ours.classify(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"), task=task)
            assert got.shape == ref.shape
            worst[f"{task} {what}"] = (got - ref).abs().max().item()
            assert ref.abs().max() > 1e-3
    assert max(worst.values()) <= TOL, worst
    with torch.no_grad():  # guard against a comparison that cannot fail: the task kinds give different logits
        batch = dict(arch_built.tokenizer(SENTENCES, padding=True, return_tensors="pt"))
        single, head = (ours.classify(batch["input_ids"], batch["attention_mask"], task=t) for t in ("single", "head"))
    assert (single - head).abs().max() > 1e-2


def test_sites_follow_the_adapter_architecture(arch_built, ours):
    """seq_bn adapters sit after the FFN only; double_seq_bn (Houlsby) adapters after the attention block too,
    each place with its own fusion weights; beta's leave_out removes it from both places of layer 1."""
    places = ("output",) if arch_built.adapter_config == "seq_bn" else ("attention", "output")
    assert ours.sites == tuple(Site(i, p) for i in range(LAYERS) for p in places)
    info = ours.infos["dyn"]
    for site, present in zip(ours.sites, info.adapters_per_layer, strict=True):
        assert present == (("alpha", "gamma") if site.layer == 1 else ("alpha", "beta", "gamma")), site
    assert ours.backbone.arch.name == arch_built.arch


def test_fusion_activations_match_adapterhub_at_every_site(arch_built, ours):
    batch = dict(arch_built.tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    ref = arch_built.reference_logits("dyn", batch, fusion_attentions=True).adapter_fusion_attentions["alpha,beta,gamma"]
    with torch.no_grad():
        _, acts = ours.classify(batch["input_ids"], batch["attention_mask"], task="dyn", return_fusion_activations=True)
    assert acts.shape == (len(SENTENCES), len(ours.sites), batch["input_ids"].shape[1], 3)
    real = batch["attention_mask"].bool()
    for row, site in enumerate(ours.sites):
        want = torch.as_tensor(np.asarray(ref[site.layer][PLACE_KEYS[site.place]]))  # (batch, seq, n_present)
        present = [i for i, n in enumerate(TASKS["dyn"][1]) if not (n == "beta" and site.layer == 1)]
        got = acts[:, row][..., present]
        assert (got - want)[real].abs().max() <= TOL, str(site)
        spread = (want.max(-1).values - want.min(-1).values)[real].mean()
        assert spread > 0.01  # a softmax that is not uniform: 100 x the tolerance
    assert torch.all(acts[:, [r for r, s in enumerate(ours.sites) if s.layer == 1], :, 1] == 0)  # beta left out


def test_a_spec_without_adapters_serves_its_heads(arch_built, tmp_path):
    """The plain backbone + head (what the latency benchmark compares with): no adapter, no fusion layer computed."""
    import shutil

    import yaml

    root = tmp_path / "plain"
    shutil.copytree(arch_built.spec.parent, root)
    (root / "model.yaml").write_text(yaml.safe_dump({"base_model": "base", "tasks": {"head": {"head": "heads/head"}}}))
    model = build_model(load_spec(root / "model.yaml"))
    batch = dict(arch_built.tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    with torch.no_grad():
        got = model.classify(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"), task="head")
    assert (got - arch_built.reference_logits("head", batch)).abs().max() <= TOL
    assert model.sites == tuple(Site(i, "output") for i in range(LAYERS)) and model.stacks == [()] * LAYERS


def test_distilbert_heads_cannot_use_a_pooler(arch_models, tmp_path):
    import json
    import shutil

    from fusionserve.errors import CheckpointError

    root = tmp_path / "m"
    shutil.copytree(arch_models("distilbert", "seq_bn").spec.parent, root)
    path = root / "heads/dyn/head_config.json"
    config = json.loads(path.read_text())
    config["config"]["use_pooler"] = True
    path.write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"(?s)(?=.*head_config\.json)(?=.*'config\.use_pooler' = True)(?=.*distilbert has no pooler)"
    ):
        build_model(load_spec(root / "model.yaml"))
