"""Shared by the tests of heads beyond classification (test_heads_*.py): the tiny model of adapterhub_models with more
heads added and saved by the real AdapterHub library, exported; AdapterHub's own answers for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fusionserve.export.artifact import export_artifact
from tests.adapterhub_models import Built, build
from tests.made_once import export_once

MAX_SEQ_LEN = 32
# task -> (head kind, how it runs: fusion over adapters / one adapter, the adapters)
HEAD_TASKS = {
    "sts": ("regression", "fusion", ["gamma", "beta", "alpha"]),  # the last adapter acts in every layer (beta skips one)
    "sick": ("regression", "adapter", ["gamma"]),
    "swag": ("multiple_choice", "fusion", ["gamma", "beta", "alpha"]),
    "ner": ("tagging", "fusion", ["gamma", "beta", "alpha"]),
    "squad": ("question_answering", "adapter", ["alpha"]),
}
NUM_CHOICES = 3  # the multiple-choice head's trained count
TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


@dataclass
class HeadsModel:
    built: Built
    spec: Path
    artifact: Path

    def activate(self, task: str) -> torch.nn.Module:
        """AdapterHub's model computing ``task`` (one of HEAD_TASKS): its adapters and head active."""
        from adapters.composition import Fuse

        _, how, names = HEAD_TASKS[task]
        model = self.built.reference
        model.set_active_adapters(Fuse(*names) if how == "fusion" else names[0])
        model.active_head = task
        for layer in model.bert.encoder.layer:  # the library anneals T even in eval; a trained model sits at 1
            for fusion in layer.output.adapter_fusion_layer.values():
                fusion.T = 1.0
        return model

    def pipeline(self, task: str) -> Callable[..., Any]:
        """The Hugging Face pipeline of ``task``'s kind on AdapterHub's own model (``token-classification`` for tagging,
        ``question-answering`` for QA), making the model compute ``task`` at each call (the heads share one model)."""
        from transformers import pipeline
        from transformers.utils import logging

        kind = "token-classification" if HEAD_TASKS[task][0] == "tagging" else "question-answering"
        was = logging.get_verbosity()
        logging.set_verbosity(logging.CRITICAL)  # it says, at ERROR, that it does not know the class of the model
        try:
            nlp = pipeline(kind, model=self.activate(task), tokenizer=self.built.tokenizer, device="cpu")
        finally:
            logging.set_verbosity(was)

        def run(*args: Any, **kwargs: Any) -> Any:
            self.activate(task)
            return nlp(*args, **kwargs)

        return run

    def reference(self, task: str, texts: list, **encode: object) -> np.ndarray:
        """AdapterHub's own logits for ``task`` (one of HEAD_TASKS) on ``texts`` (strings or (text, pair) tuples);
        a multiple-choice task's per (context, choice) pair, each pair one row."""
        model, tok = self.activate(task), self.built.tokenizer
        if HEAD_TASKS[task][0] == "multiple_choice":  # texts: (context, choices) with NUM_CHOICES choices each
            out = []
            for context, choices in texts:
                batch = tok([context] * len(choices), list(choices), padding=True, truncation=True, max_length=MAX_SEQ_LEN,
                            return_tensors="pt")  # fmt: skip
                with torch.no_grad():  # AdapterHub's input for multiple choice: (batch, choices, seq)
                    out.append(model(**{k: v[None] for k, v in batch.items()}).logits.numpy()[0])
            return np.stack(out)
        rows = []
        for t in texts:  # one at a time: a batch would pair every text or none
            args = (t,) if isinstance(t, str) else tuple(t)
            batch = tok(*args, truncation=True, max_length=MAX_SEQ_LEN, return_tensors="pt", **encode)
            with torch.no_grad():
                rows.append(model(**batch).logits.numpy()[0])
        return np.stack(rows)


def build_heads(root: Path, seed: int = 0, live: bool = False, leave_out: tuple[str, ...] = (), shared: Any = None) -> HeadsModel:
    """The tiny AdapterHub model (adapterhub_models.build) with HEAD_TASKS' heads added, perturbed, saved by the library
    (heads/<task>, fusions/<task>), named in the spec, and the spec exported but for ``leave_out`` (fp32; ``live``: as a
    live artifact, whose left-out tasks `fusionserve tasks add` can add). ``shared``: the session's tmp_path_factory,
    to export once per test run for every module that builds the same model (made_once.export_once); the build, and
    AdapterHub's model in memory, stay this call's own."""
    from adapters.composition import Fuse

    root.mkdir(parents=True, exist_ok=True)
    built = build(root, safetensors=True, seed=seed)
    model = built.reference
    spec = yaml.safe_load((root / "model.yaml").read_text())
    gen = torch.Generator().manual_seed(seed + 7)
    for task, (kind, how, names) in HEAD_TASKS.items():
        if kind == "regression":
            model.add_classification_head(task, num_labels=1)
        elif kind == "multiple_choice":
            model.add_multiple_choice_head(task, num_choices=NUM_CHOICES)
        elif kind == "tagging":
            model.add_tagging_head(task, num_labels=len(TAGS), id2label=dict(enumerate(TAGS)))
        elif kind == "question_answering":
            model.add_qa_head(task)
        fused = ",".join(names)
        new = how == "fusion" and fused not in model.bert.encoder.layer[0].output.adapter_fusion_layer
        if new:  # tasks may share a fusion: it is added (and perturbed) once
            model.add_adapter_fusion(Fuse(*names), config="dynamic")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(f"heads.{task}.") or (new and f"adapter_fusion_layer.{fused}." in name):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        model.save_head(str(root / "heads" / task), task)
        entry = {"head": f"heads/{task}"}
        if how == "fusion":
            model.save_adapter_fusion(str(root / "fusions" / task), ",".join(names))
            entry["fusion"] = f"fusions/{task}"
        else:
            entry["adapter"] = names[0]
        spec["tasks"][task] = entry
    model.eval()
    (root / "model.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    tasks = [t for t in spec["tasks"] if t not in leave_out]
    if shared is not None:
        artifact = export_once(shared, "heads", root / "model.yaml", max_seq_len=MAX_SEQ_LEN, live=live, tasks=tasks)
    else:
        artifact = root / "artifact"
        export_artifact(root / "model.yaml", artifact, max_seq_len=MAX_SEQ_LEN, progress=False, live=live, tasks=tasks)
    return HeadsModel(built, root / "model.yaml", artifact)


if __name__ == "__main__":  # python -m tests.heads_helpers DIR: the tiny model with every head, exported (the guide's demo)
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "heads-demo")
    print(build_heads(out).artifact)
