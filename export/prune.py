"""``fusionserve prune``: drop the adapters a fusion hardly uses, as measured by ``fusionserve calibrate``.

A rule keeps, per pruned task, the top K adapters or those whose mean fusion weight reaches X, either globally
(one choice for every layer, ranked by the mean over layers) or per layer; ``drop_layers`` removes the task's
fusion from whole layers (AdapterDrop: the last layers matter least). The softmax renormalises over the adapters
kept. Only the tasks in the stats file are pruned; every other task, every head and the task list stay as they
were. A layer's stack keeps an adapter while any served task still uses it there, so pruning saves time only
where no other task needs the adapter (serve a subset with ``tasks`` to prune a model down to its target).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import FusionServeError
from fusionserve.serving.model.activations import load_stats
from fusionserve.serving.model.artifact import sha256

from .int8.quantize import DEFAULT_OPTIONS, Int8Options
from .model import TaskInfo


class PruneError(FusionServeError):
    """Pruning options that cannot be applied to this model or these statistics."""


@dataclass(frozen=True)
class PruneRule:
    """What to keep. Exactly one of ``keep_top`` and ``min_activation``; ``drop_layers`` may be negative (-1: last)."""

    keep_top: int | None = None
    min_activation: float | None = None
    per_layer: bool = False
    drop_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.keep_top is None) == (self.min_activation is None):
            raise PruneError("give exactly one of --keep-top K and --min-activation X")
        if self.keep_top is not None and (isinstance(self.keep_top, bool) or self.keep_top < 1):
            raise PruneError(f"--keep-top must be at least 1, got {self.keep_top}")
        if self.min_activation is not None and not 0.0 <= self.min_activation <= 1.0:
            raise PruneError(f"--min-activation is a softmax weight between 0 and 1, got {self.min_activation}")

    def summary(self) -> str:
        what = f"keep top {self.keep_top}" if self.keep_top is not None else f"keep mean weight >= {self.min_activation:g}"
        where = "per layer" if self.per_layer else "in every layer (ranked by the mean over layers)"
        drop = f"; fusion dropped in layer(s) {', '.join(map(str, self.drop_layers))}" if self.drop_layers else ""
        return f"{what} {where}{drop}"


@dataclass(frozen=True)
class TaskPlan:
    """One task's pruning: per layer, the adapters kept, and why each other one went."""

    task: str
    kept_per_layer: tuple[tuple[str, ...], ...]
    dropped_per_layer: tuple[dict[str, str], ...]  # per layer: adapter -> why

    def as_dict(self) -> dict[str, Any]:
        kept = sorted({a for layer in self.kept_per_layer for a in layer})
        gone = sorted({a for layer in self.dropped_per_layer for a in layer} - set(kept))
        return {
            "kept": kept,
            "dropped_everywhere": gone,
            "kept_per_layer": [list(layer) for layer in self.kept_per_layer],
            "dropped_per_layer": [dict(layer) for layer in self.dropped_per_layer],
        }


def _layers(drop: Sequence[int], n_layers: int) -> tuple[int, ...]:
    out = []
    for layer in drop:
        if not -n_layers <= layer < n_layers:
            raise PruneError(
                f"--drop-layers {layer}: the base model has {n_layers} layers (0 to {n_layers - 1}, or -1 for the last)"
            )
        out.append(layer % n_layers)
    return tuple(sorted(set(out)))


def _choose(scores: dict[str, float], rule: PruneRule) -> tuple[list[str], dict[str, str]]:
    """Kept names (best first) and the reason for each dropped one."""
    ranked = sorted(scores, key=lambda a: -scores[a])  # stable: ties keep the fusion's order
    if rule.keep_top is not None:
        kept = ranked[: rule.keep_top]
        why = {
            a: f"mean weight {scores[a]:.4f}, rank {ranked.index(a) + 1} of {len(ranked)}: not in the top {rule.keep_top}"
            for a in ranked[len(kept) :]
        }
        return kept, why
    threshold = rule.min_activation or 0.0
    kept = [a for a in ranked if scores[a] >= threshold] or ranked[:1]  # a softmax needs at least one adapter
    why = {a: f"mean weight {scores[a]:.4f} < {threshold:g}" for a in ranked if a not in kept}
    return kept, why


def plan(doc: Mapping[str, Any], infos: Mapping[str, TaskInfo], rule: PruneRule, n_layers: int) -> dict[str, TaskPlan]:
    """The pruning of each task in the stats ``doc`` that ``infos`` serves. Raises PruneError when the statistics do
    not describe these tasks, a task has no fusion, K exceeds a fusion's adapters, or a layer does not exist."""
    drop = _layers(rule.drop_layers, n_layers)
    stats = doc["tasks"]
    fusion_tasks = [n for n, i in infos.items() if i.kind == "fusion"]
    served = [t for t in stats if t in infos]
    if not served:
        raise PruneError(
            f"the stats describe task(s) {', '.join(stats)}, none of which this model serves "
            f"(fusion tasks: {', '.join(fusion_tasks) or 'none'})"
        )
    plans = {}
    for task in served:
        info, s = infos[task], stats[task]
        if info.kind != "fusion":
            raise PruneError(f"task '{task}' has no fusion layer ({info.kind} task); only fusions are pruned")
        if tuple(s["adapters"]) != info.adapters or len(s["mean"]) != n_layers:
            raise PruneError(
                f"the stats of task '{task}' cover adapters {s['adapters']} over {len(s['mean'])} layers, but its fusion "
                f"mixes {list(info.adapters)} over {n_layers}: calibrate the unpruned model this spec builds"
            )
        if rule.keep_top is not None and rule.keep_top > len(info.adapters):
            raise PruneError(
                f"--keep-top {rule.keep_top}: task '{task}' fuses only {len(info.adapters)} adapters ({', '.join(info.adapters)})"
            )
        mean = np.asarray(s["mean"], dtype=np.float64)  # (layers, adapters)
        column = {a: j for j, a in enumerate(info.adapters)}
        if not rule.per_layer:
            overall = {a: float(s["mean_over_layers"][a]) for a in info.adapters}
            keep, why = _choose(overall, rule)
        kept_layers: list[tuple[str, ...]] = []
        dropped_layers: list[dict[str, str]] = []
        for layer, present in enumerate(info.adapters_per_layer):
            if layer in drop:
                kept_layers.append(())
                dropped_layers.append({a: f"layer {layer} dropped (--drop-layers)" for a in present})
                continue
            if rule.per_layer:
                keep, why = _choose({a: float(mean[layer, column[a]]) for a in present}, rule)
            kept_layers.append(tuple(a for a in info.adapters if a in present and a in keep))
            dropped_layers.append({a: why[a] for a in present if a not in keep})
        if not any(kept_layers):
            raise PruneError(f"these options leave task '{task}' no adapter in any layer; keep at least one layer")
        plans[task] = TaskPlan(task, tuple(kept_layers), tuple(dropped_layers))
    return plans


def dropped(plans: Mapping[str, TaskPlan], infos: Mapping[str, TaskInfo]) -> dict[str, list[frozenset[str]]]:
    """Per task and layer, the adapters to remove: what ``build.build_model`` takes."""
    return {task: [frozenset(set(infos[task].adapters) - set(kept)) for kept in p.kept_per_layer] for task, p in plans.items()}


def prune_artifact(
    spec_path: str | Path,
    stats_path: str | Path,
    rule: PruneRule,
    out: str | Path,
    tasks: Sequence[str] | None = None,
    precision: str = "fp32",
    max_seq_len: int | None = None,
    force: bool = False,
    progress: bool = True,
    int8: Int8Options = DEFAULT_OPTIONS,
) -> tuple[dict[str, Any], dict[str, TaskPlan]]:
    """Export the spec (only ``tasks`` when given) with its calibrated fusions pruned by ``rule``; the manifest's
    ``pruning`` field records the rule, the statistics and, per task and layer, what was kept and why the rest went.

    Raises PruneError or CalibrationError (options or statistics that do not fit), plus everything
    ``export_artifact`` raises."""
    from .artifact import export_artifact
    from .build import build_model
    from .spec import load_spec

    doc = load_stats(stats_path)
    if Path(stats_path).resolve().is_relative_to(Path(out).resolve()):
        raise PruneError(f"--out {out} holds --stats {stats_path}; the export would replace it: choose another folder")
    spec = load_spec(spec_path)
    if tasks:
        spec = spec.select(tasks)
    model = build_model(spec)  # the unpruned model: what the statistics must describe
    infos = model.task_infos
    n_layers = len(model.sites)  # fusion layers: one per site (checkpoint.Site)
    rule = replace(rule, drop_layers=_layers(rule.drop_layers, n_layers))  # -1 -> the last layer's index
    plans = plan(doc, infos, rule, n_layers)
    record = {
        "rule": {
            "keep_top": rule.keep_top,
            "min_activation": rule.min_activation,
            "per_layer": rule.per_layer,
            "drop_layers": list(rule.drop_layers),
            "summary": rule.summary(),
        },
        "stats": {
            "path": str(Path(stats_path).resolve()),
            "sha256": sha256(Path(stats_path)),
            "input": doc.get("input", {}).get("path"),
            "tokens": {t: doc["tasks"][t]["tokens"] for t in plans},
        },
        "tasks": {t: p.as_dict() for t, p in plans.items()},
    }
    del model
    manifest = export_artifact(
        spec_path, out, precision, max_seq_len, force=force, progress=progress,
        tasks=tasks, dropped=dropped(plans, infos), pruning=record, int8=int8,
    )  # fmt: skip
    return manifest, plans


def _row_names(manifest: Mapping[str, Any]) -> list[str]:
    """The fusion layers by name: 'layer i' when they are the layers' FFN sites, else 'layer i attention' / 'output'
    (Houlsby adapters: two fusion layers per transformer layer, which --drop-layers counts one by one)."""
    sites = manifest.get("fusion_layers") or [{"layer": i, "place": "output"} for i in range(len(manifest["adapters_per_layer"]))]
    if all(s["place"] == "output" for s in sites):
        return [f"layer {s['layer']}" for s in sites]
    return [f"layer {s['layer']} {s['place']}" for s in sites]


def render(plans: Mapping[str, TaskPlan], manifest: Mapping[str, Any]) -> str:
    """What the prune command prints: kept adapters per layer and the stack sizes."""
    lines = [f"rule: {manifest['pruning']['rule']['summary']}"]
    for task, p in plans.items():
        d = p.as_dict()
        lines.append(f"{task}: kept {', '.join(d['kept'])}; dropped everywhere: {', '.join(d['dropped_everywhere']) or '-'}")
        for name, kept in zip(_row_names(manifest), p.kept_per_layer, strict=True):
            lines.append(f"  {name}: {', '.join(kept) or '- (fusion dropped)'}")
    sizes = ", ".join(str(len(stack)) for stack in manifest["adapters_per_layer"])
    lines.append(f"adapters computed per layer (all served tasks): {sizes}")
    return "\n".join(lines)
