"""Tiny AdapterFusion models built and saved by the real AdapterHub ``adapters`` library, for parity tests.

Nothing here is fusionserve code: the reference model is the library's own BertAdapterModel, saved with
its own save functions, so the tests compare fusionserve against what AdapterHub computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

WORDS = [
    "the",
    "a",
    "movie",
    "film",
    "was",
    "great",
    "good",
    "bad",
    "awful",
    "plot",
    "actor",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "it",
    "is",
    "not",
    "very",
    "fun",
    "boring",
    "and",
]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]

TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37, vocab_size=len(VOCAB))

# task -> (kind, fused adapters or adapter, fusion config, labels)
TASKS = {
    "rte": ("fusion", ["alpha", "beta", "gamma"], "dynamic", ["entailment", "neutral", "contradiction"]),
    "nli": ("fusion", ["beta", "alpha"], "static", ["yes", "no"]),
    "custom": (
        "fusion",
        ["gamma", "alpha"],
        dict(
            key=False,
            query=True,
            value=False,
            query_before_ln=True,
            regularization=False,
            residual_before=False,
            temperature=True,
            value_before_softmax=False,
            value_initialized=False,
            dropout_prob=None,
        ),
        ["p", "q", "r", "s"],
    ),
    "flat": (  # no query, key or value: AdapterHub scores raw adapter outputs against the layer output
        "fusion",
        ["alpha", "gamma"],
        dict(
            key=False,
            query=False,
            value=False,
            query_before_ln=False,
            regularization=False,
            residual_before=False,
            temperature=False,
            value_before_softmax=True,
            value_initialized=False,
            dropout_prob=None,
        ),
        ["u", "v"],
    ),
    "alpha_only": ("adapter", ["alpha"], None, ["neg", "pos"]),
    "beta_only": ("adapter", ["beta"], None, ["x", "y", "z"]),
    "head_only": ("head", [], None, ["off", "on"]),
}


@dataclass
class Built:
    spec: Path
    reference: torch.nn.Module  # adapters.BertAdapterModel with everything loaded
    tokenizer: object

    def reference_logits(self, task: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from adapters.composition import Fuse

        kind, names, _, _ = TASKS[task]
        model = self.reference
        if kind == "fusion":
            model.set_active_adapters(Fuse(*names))
        elif kind == "adapter":
            model.set_active_adapters(names[0])
        else:
            model.set_active_adapters(None)
        model.active_head = task
        for layer in model.bert.encoder.layer:  # the library anneals T even in eval; a trained model sits at 1
            for fusion in layer.output.adapter_fusion_layer.values():
                fusion.T = 1.0
        with torch.no_grad():
            return model(**batch).logits


def save_spec(model: Any, root: Path, tasks: dict, safetensors: bool = True) -> None:
    """Save adapters alpha/beta/gamma, every task's head (and fusion) with the adapters library's own functions, and
    write root/model.yaml naming them. ``tasks``: name -> (kind, adapter names, fusion config, labels)."""
    spec: dict = {"base_model": "base", "adapters": {}, "tasks": {}}
    for sub in ("adapters", "heads", "fusions"):
        (root / sub).mkdir()
    for name in ("alpha", "beta", "gamma"):
        model.save_adapter(str(root / "adapters" / name), name, use_safetensors=safetensors)
        spec["adapters"][name] = f"adapters/{name}"
    for task, (kind, names, _, _) in tasks.items():
        model.save_head(str(root / "heads" / task), task, use_safetensors=safetensors)
        entry: dict[str, str] = {"head": f"heads/{task}"}
        if kind == "fusion":
            model.save_adapter_fusion(str(root / "fusions" / task), ",".join(names), use_safetensors=safetensors)
            entry["fusion"] = f"fusions/{task}"
        elif kind == "adapter":
            entry["adapter"] = names[0]
        spec["tasks"][task] = entry
    (root / "model.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def write_base(folder: Path, seed: int = 0, **overrides: int) -> None:
    """A random tiny BERT saved as a HF model folder with a WordPiece tokenizer."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(seed)
    BertModel(BertConfig(**{**TINY, **overrides})).save_pretrained(str(folder))


def build(root: Path, safetensors: bool, seed: int = 0) -> Built:
    """Build a BertAdapterModel with three adapters (one with leave_out), three fusions and six heads,
    perturb every adapter/fusion/head weight away from its init, save all of it the library's way and
    write a spec over the saved folders."""
    import adapters
    from adapters import BertAdapterModel, SeqBnConfig
    from adapters.composition import Fuse
    from transformers import BertTokenizerFast

    assert adapters.__version__ == "1.3.0", adapters.__version__
    write_base(root / "base", seed)
    model = BertAdapterModel.from_pretrained(str(root / "base"))
    model.add_adapter("alpha", config=SeqBnConfig(reduction_factor=4))
    model.add_adapter("beta", config=SeqBnConfig(reduction_factor=8, leave_out=[1]))
    model.add_adapter("gamma", config=SeqBnConfig(reduction_factor=2, scaling=0.5))
    for task, (kind, names, fusion_cfg, labels) in TASKS.items():
        if kind == "fusion":
            model.add_adapter_fusion(Fuse(*names), config=fusion_cfg)
        model.add_classification_head(task, num_labels=len(labels), id2label=dict(enumerate(labels)))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapters." in name or "adapter_fusion_layer" in name or name.startswith("heads."):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()

    save_spec(model, root, TASKS, safetensors)
    return Built(root / "model.yaml", model, BertTokenizerFast.from_pretrained(str(root / "base")))


SENTENCES = [
    "the movie was great",
    "a bad plot and an awful actor it is not very fun",
    "the cat sat on the mat",
    "boring",
    "the dog is good and the film is great and the plot is not boring",
]
PAIRS = [("the cat sat", "the dog sat on the mat"), ("great movie", "it is not very fun"), ("a", "the plot")]


if __name__ == "__main__":  # python -m tests.adapterhub_models DIR: a tiny random demo model, for trying the CLI
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-model")
    print(build(out, safetensors=True).spec)
