"""Shared by the live-task tests (test_live_tasks.py, test_head_kinds_export.py, test_live_serving.py): a tiny model saved
by AdapterHub, exported live with some of its tasks, so that the others can be added later; the extra heads the
refusals need; answers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fusionserve.export.artifact import export_artifact
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import OnnxRunner
from tests.adapterhub_models import SENTENCES, Built, build
from tests.made_once import made_once, source_digest

MAX_SEQ_LEN = 40
FIRST = ("custom", "alpha_only", "head_only")  # exported: serves adapters alpha and gamma, logits 4 wide


@dataclass
class LiveModel:
    built: Built
    root: Path  # the AdapterHub folders: fusions/<task>, heads/<task>, heads/five, heads/one_layer
    artifact: Path  # the live export of FIRST (fp32); copy it before changing it (live_once's is shared)

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.artifact, to)
        return to

    def reference(self, task: str, texts: list[str] = SENTENCES) -> np.ndarray:
        """AdapterHub's own answer for one of adapterhub_models.TASKS (Fuse for a fusion task)."""
        batch = self.built.tokenizer(texts, padding=True, truncation=True, max_length=MAX_SEQ_LEN, return_tensors="pt")
        return self.built.reference_logits(task, dict(batch)).numpy()


def build_live(root: Path) -> Built:
    """The AdapterHub model under ``root``, with two extra heads (five labels, and one linear layer) that no export
    names: the same files on every call (seeded)."""
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
    return built


def _export_live(spec: Path, artifact: Path, precision: str, dropped: dict | None, tasks: tuple[str, ...]) -> None:
    export_artifact(
        spec, artifact, precision=precision, max_seq_len=MAX_SEQ_LEN, progress=False, tasks=tasks, live=True,
        parity_grid="quick", dropped=dropped,
    )  # fmt: skip


def make_live(
    root: Path, precision: str = "fp32", dropped: dict | None = None, out: Path | None = None, tasks: tuple[str, ...] = FIRST
) -> LiveModel:
    """Build the AdapterHub model under ``root`` (``build_live``) and export ``tasks`` live (``dropped``: pruned): an
    artifact of the caller's own, free to change in place."""
    built = build_live(root)
    artifact = out or root / "artifact"
    _export_live(built.spec, artifact, precision, dropped, tasks)
    return LiveModel(built, root, artifact)


def live_once(tmp_path_factory: pytest.TempPathFactory, root: Path) -> LiveModel:
    """``make_live(root)``'s model built under ``root``, with the live export of FIRST (fp32) made once per test run
    (tests/made_once.py) and read by every module and worker that asks: a test copies it (``LiveModel.copy``) before
    it adds or removes a task. The caller's build is its own (its in-memory reference, its folders)."""
    built = build_live(root)
    make = lambda folder: _export_live(built.spec, folder / "artifact", "fp32", None, FIRST)  # noqa: E731
    artifact = made_once(tmp_path_factory, f"live-{source_digest(built.spec)}", make) / "artifact"
    return LiveModel(built, root, artifact)


def answers(artifact: Path, task: str, texts: list[str] = SENTENCES) -> np.ndarray:
    """fusionserve's logits for ``task`` on the artifact's published revision."""
    return OnnxRunner(artifact, threads=1).logits(task, [TextInput(t) for t in texts])[0]
