"""Shared by the live-task tests (test_live_tasks.py, test_live_serving.py): a tiny model saved by AdapterHub, exported
live with some of its tasks, so that the others can be added later; the extra heads the refusals need; answers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fusionserve.export.artifact import export_artifact
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import SENTENCES, Built, build

MAX_SEQ_LEN = 40
FIRST = ("custom", "alpha_only", "head_only")  # exported: serves adapters alpha and gamma, logits 4 wide


@dataclass
class LiveModel:
    built: Built
    root: Path  # the AdapterHub folders: fusions/<task>, heads/<task>, heads/five, heads/one_layer
    artifact: Path  # the live export of FIRST (fp32); copy it before changing it

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.artifact, to)
        return to

    def reference(self, task: str, texts: list[str] = SENTENCES) -> np.ndarray:
        """AdapterHub's own answer for one of adapterhub_models.TASKS (Fuse for a fusion task)."""
        batch = self.built.tokenizer(texts, padding=True, truncation=True, max_length=MAX_SEQ_LEN, return_tensors="pt")
        return self.built.reference_logits(task, dict(batch)).numpy()


def make_live(
    root: Path, precision: str = "fp32", dropped: dict | None = None, out: Path | None = None, tasks: tuple[str, ...] = FIRST
) -> LiveModel:
    """Build the AdapterHub model under ``root`` (with two extra heads: five labels, and one linear layer) and export
    ``tasks`` live (``dropped``: pruned)."""
    built = build(root, safetensors=True, seed=5)
    model = built.reference
    model.add_classification_head("five", num_labels=5)
    model.add_classification_head("one_layer", num_labels=2, layers=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("heads.five", "heads.one_layer")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.3)
    for head in ("five", "one_layer"):
        model.save_head(str(root / "heads" / head), head)
    artifact = out or root / "artifact"
    export_artifact(
        built.spec, artifact, precision=precision, max_seq_len=MAX_SEQ_LEN, progress=False, tasks=tasks, live=True,
        parity_grid="quick", dropped=dropped,
    )  # fmt: skip
    return LiveModel(built, root, artifact)


def answers(artifact: Path, task: str, texts: list[str] = SENTENCES) -> np.ndarray:
    """fusionserve's logits for ``task`` on the artifact's published revision."""
    return OnnxRunner(artifact, threads=1).logits(task, [TextInput(t) for t in texts])[0]
