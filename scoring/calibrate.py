"""``fusionserve calibrate``: how much weight each fusion layer gives each adapter on real inputs.

Runs a model (artifact or spec) over a JSONL file and records, per target task, layer and adapter, the mean and
standard deviation of the fusion softmax weight over every real token (padding excluded). The statistics file
format (``serving.activations``) is what ``fusionserve prune`` reads; a heat map (layers x adapters) shows it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import InputError, MissingDependency
from fusionserve.serving.model.activations import token_sums
from fusionserve.serving.model.artifact import TaskEntry
from fusionserve.serving.model.runner import ActivationRunner

from .files import open_output
from .inputs import LabelledInput, batched


@dataclass
class _Moments:
    """Running sums over real tokens of the softmax weight and its square, per (layer, adapter)."""

    entry: TaskEntry
    s1: np.ndarray | None = None  # (layers, adapters) float64
    s2: np.ndarray | None = None
    tokens: int = 0
    examples: int = 0

    def add(self, acts: np.ndarray, mask: np.ndarray) -> None:
        a = acts.astype(np.float64)  # (batch, layers, seq, adapters)
        s1 = token_sums(a, mask, np.float64).sum(axis=0)  # (layers, adapters), over real tokens
        s2 = token_sums(a * a, mask, np.float64).sum(axis=0)
        self.s1 = s1 if self.s1 is None else self.s1 + s1
        self.s2 = s2 if self.s2 is None else self.s2 + s2
        self.tokens += int(mask.sum())
        self.examples += int(acts.shape[0])

    def result(self) -> dict[str, Any]:
        if self.s1 is None or self.s2 is None or not self.tokens:
            raise InputError(f"task '{self.entry.name}': no input could be run; nothing to calibrate on")
        mean = self.s1 / self.tokens
        std = np.sqrt(np.maximum(self.s2 / self.tokens - mean * mean, 0.0))
        per_layer = self.entry.adapters_per_layer or tuple(self.entry.adapters for _ in range(mean.shape[0]))
        over_layers = {}
        for j, name in enumerate(self.entry.adapters):
            layers = [i for i, present in enumerate(per_layer) if name in present]
            over_layers[name] = round(float(mean[layers, j].mean()), 6) if layers else 0.0
        return {
            "adapters": list(self.entry.adapters),
            "adapters_per_layer": [list(layer) for layer in per_layer],
            "examples": self.examples,
            "tokens": self.tokens,
            "mean": np.round(mean, 6).tolist(),
            "std": np.round(std, 6).tolist(),
            "mean_over_layers": over_layers,
        }


def calibrate(
    runner: ActivationRunner,
    tasks: Sequence[str],
    inputs: Iterator[tuple[int, LabelledInput | InputError]],
    batch_size: int = 32,
    progress: bool = False,
) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """Activation statistics of each task in ``tasks`` over ``inputs``; returns (stats, bad lines with the reason).

    Raises FusionServeError for an unknown task or one without fusion, InputError when no line is usable."""
    from tqdm import tqdm

    if not tasks:
        raise InputError("name at least one task to calibrate (--task)")
    moments = {}
    for name in tasks:
        entry = runner.task(name)
        if entry.kind != "fusion":
            raise InputError(f"task '{name}' has no fusion layer ({entry.kind} task); only fusion tasks can be calibrated")
        moments[name] = _Moments(entry)
    bad: list[tuple[int, str]] = []
    bar = tqdm(desc="calibrate " + ", ".join(tasks), unit="text", disable=not progress, file=sys.stderr)
    for batch in batched(inputs, batch_size):
        good = [x.input for _, x in batch if isinstance(x, LabelledInput)]
        bad += [(no, str(x)) for no, x in batch if isinstance(x, InputError)]
        if good:
            encoded = runner.encoder.encode(good)
            for name, m in moments.items():
                acts = runner.run(name, encoded, return_fusion_activations=True).fusion_activations
                if acts is None:
                    raise RuntimeError(f"the runner returned no fusion activations for task '{name}'")
                m.add(acts, encoded.attention_mask)
        bar.update(len(batch))
    bar.close()
    return {name: m.result() for name, m in moments.items()}, bad


def plot_heatmap(doc: dict[str, Any], out: Path) -> Path:
    """One panel per task: mean fusion weight per layer (rows) and adapter (columns). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependency("the heat map needs matplotlib: pip install matplotlib (or fusionserve[export])") from None
    tasks = doc["tasks"]
    widest = max(len(t["adapters"]) for t in tasks.values())
    fig, axes = plt.subplots(len(tasks), 1, figsize=(1.2 + 0.9 * widest, 0.6 + 2.4 * len(tasks)), squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], tasks.items(), strict=True):
        mean, std = np.asarray(t["mean"], dtype=np.float64), np.asarray(t["std"], dtype=np.float64)
        present = np.array([[a in layer for a in t["adapters"]] for layer in t["adapters_per_layer"]])
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
        image = ax.imshow(np.where(present, mean, np.nan), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(t["adapters"])), t["adapters"], rotation=30, ha="right")
        ax.set_yticks(range(mean.shape[0]), [f"layer {i}" for i in range(mean.shape[0])])
        for (i, j), v in np.ndenumerate(mean):
            text = f"{v:.2f}\n±{std[i, j]:.2f}" if present[i, j] else "absent"
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color="white" if v < 0.5 and present[i, j] else "black")
        ax.set_title(f"{name}: fusion weight per token, mean ± std over {t['tokens']:,} tokens", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    with open_output(out, "wb", what="--plot") as fh:
        fig.savefig(fh, format=out.suffix.lstrip(".").lower() or "png", dpi=120)
    plt.close(fig)
    return out
