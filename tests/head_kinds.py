"""Every head kind AdapterHub trains (regression, multiple choice, tagging, extractive QA), added by the real ``adapters``
library to the tiny models of adapterhub_models / backbone_models, moved away from their init, saved with its own
``save_head``; a spec serving each kind fused (over the model's 'dynamic' fusion of alpha, beta, gamma) and over the
single adapter gamma; AdapterHub's own outputs for them, in the shape fusionserve gives them.

Nothing here is fusionserve code: the reference is the library's model with its own head active.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from tests.adapterhub_models import PAIRS, SENTENCES

TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
# head name -> (kind as the manifest names it, AdapterHub's method adding it, its arguments)
HEADS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "score": ("regression", "add_classification_head", {"num_labels": 1}),
    "choose": ("multiple_choice", "add_multiple_choice_head", {"num_choices": 3}),
    "tags": ("tagging", "add_tagging_head", {"num_labels": len(TAGS), "id2label": dict(enumerate(TAGS))}),
    "span": ("question_answering", "add_qa_head", {}),
}
FUSED, SINGLE = ("alpha", "beta", "gamma"), "gamma"
CONTEXTS = [
    ("the cat sat on the mat", ("the dog", "a cat sat", "not very fun")),
    ("a great movie", ("it is good", "bad", "the plot")),
]


def task(head: str, how: str) -> str:
    """The spec's task serving ``head`` fused ("fused") or over the single adapter ("single")."""
    return f"{head}_{how}"


def kind(name: str) -> str:
    """The head kind of task ``name``."""
    head = name.rsplit("_", 1)[0]
    return HEADS[head][0] if head in HEADS else "classification"


@dataclass
class HeadKinds:
    spec: Path
    reference: torch.nn.Module  # the adapters library's model holding these heads and the adapters/fusion
    tokenizer: Any
    classification: str  # the library model's classification head that task "label_fused" serves

    def activate(self, head: str, adapters: tuple[str, ...] | str) -> None:
        """Make the library's model compute ``head`` over Fuse(*adapters), or over the one adapter named."""
        from adapters.composition import Fuse
        from adapters.methods.modeling import BertFusion

        self.reference.set_active_adapters(Fuse(*adapters) if isinstance(adapters, tuple) else adapters)
        self.reference.active_head = head
        for module in self.reference.modules():  # the library anneals T even in eval; a trained model sits at 1
            if isinstance(module, BertFusion):
                module.T = 1.0

    def setup(self, name: str) -> tuple[str, tuple[str, ...] | str]:
        """(head, adapters) of the spec's task ``name``."""
        head, how = name.rsplit("_", 1)
        return (self.classification if head == "label" else head), (FUSED if how == "fused" else SINGLE)

    def outputs(self, name: str, batch: dict[str, torch.Tensor], adapters: tuple[str, ...] | str | None = None) -> np.ndarray:
        """AdapterHub's output of task ``name`` (or of its head over ``adapters``) on ``batch``, as fusionserve's model
        gives it: (batch, labels), (batch, 1) for regression; (batch, seq, labels) for tagging; (batch, seq, 2) start and
        end for QA. Multiple choice: see ``choices``."""
        head, own = self.setup(name)
        self.activate(head, own if adapters is None else adapters)
        with torch.no_grad():
            out = self.reference(**batch)
        if kind(name) == "question_answering":
            return torch.stack([out.start_logits, out.end_logits], dim=-1).numpy()
        return out.logits.numpy()

    def choices(
        self, name: str, contexts: list = CONTEXTS, adapters: tuple[str, ...] | str | None = None, **encode: Any
    ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """(rows, AdapterHub's logits (questions, choices)): every (context, choice) pair as one row, as the library's
        multiple-choice head takes them: (questions, choices, seq), reshaped."""
        firsts = [c for c, options in contexts for _ in options]
        seconds = [o for _, options in contexts for o in options]
        rows = dict(self.tokenizer(firsts, seconds, padding=True, return_tensors="pt", **encode))
        per_question = {k: v.reshape(len(contexts), -1, v.shape[-1]) for k, v in rows.items()}
        head, own = self.setup(name)
        self.activate(head, own if adapters is None else adapters)
        with torch.no_grad():
            logits = self.reference(**per_question).logits.numpy()
        return rows, logits


def add_heads(model: Any, root: Path, tokenizer: Any, classification: str, seed: int = 0) -> HeadKinds:
    """Add HEADS to the library's ``model`` (holding adapters alpha, beta, gamma and the fusion of all three, saved under
    root/adapters and root/fusions/<fusion>), move them from their init, save them with ``save_head`` under
    root/heads/<name> and write root/heads.yaml: per head one fused and one single-adapter task, and the classification
    head ``classification`` (saved under root/heads) fused as task "label_fused": every kind in one spec."""
    gen = torch.Generator().manual_seed(seed + 11)
    # the library draws each head's initial weights from torch's global generator: seeded here (and put back after),
    # or they, and the outputs the tests check, depended on what the tests before had drawn in this process (a
    # regression head answered at most 0.0057, under the test's 0.01, after a reordering of the suite)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 10)
        for name, (_, method, kwargs) in HEADS.items():
            if name not in model.heads:
                getattr(model, method)(name, **kwargs)
                with torch.no_grad():
                    for param in model.heads[name].parameters():
                        param.add_(torch.randn(param.shape, generator=gen) * 0.3)
            model.save_head(str(root / "heads" / name), name)
    model.eval()
    fusion = next(p for p in sorted((root / "fusions").iterdir()) if p.is_dir() and _fuses(p) == FUSED)
    spec: dict[str, Any] = {"base_model": "base", "adapters": {a: f"adapters/{a}" for a in FUSED}, "tasks": {}}
    spec["tasks"]["label_fused"] = {"head": f"heads/{classification}", "fusion": f"fusions/{fusion.name}"}
    for name in HEADS:
        spec["tasks"][task(name, "fused")] = {"head": f"heads/{name}", "fusion": f"fusions/{fusion.name}"}
        spec["tasks"][task(name, "single")] = {"head": f"heads/{name}", "adapter": SINGLE}
    (root / "heads.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return HeadKinds(root / "heads.yaml", model, tokenizer, classification)


def _fuses(folder: Path) -> tuple[str, ...]:
    import json

    return tuple(json.loads((folder / "adapter_fusion_config.json").read_text())["adapter_names"])


def batches(tokenizer: Any) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Padded single texts and padded pairs."""
    return [
        ("padded", dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))),
        ("pairs", dict(tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS], padding=True, return_tensors="pt"))),
    ]
