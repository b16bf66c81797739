"""Live tasks, the torch side: every per-task tensor of the model (each adapter site's folded fusion matrices, mask,
gate and query switch; each head's weights) as a *graph input* stacked over tasks, so that the served graph holds
only what all tasks share (backbone, adapter down-projections) and a task is a few small arrays beside it.

The graph gathers each row's slice of every table by ``task_id``, exactly as the baked multi-task graph gathers its
initializers; only where the tables come from changes. The tables' first axis is symbolic ("tasks"): a revision with
more or fewer tasks feeds longer or shorter tables to the same graph, with no re-trace and no new session
(``fusionserve tasks``, ``tasks.py``; serving side: ``serving/model/tables.py``, ``serving/model/revisions.py``).

Heads are stacked too, so every head of a live artifact has one form (layers, activation, pooler:
``model.HeadForm``) and its labels are zero-padded to the artifact's logits width.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fusionserve.errors import SpecError
from fusionserve.serving.model import revisions
from fusionserve.serving.model.artifact import sha256
from fusionserve.serving.model.files import rename_durable
from fusionserve.serving.model.revisions import TASK_FILES
from fusionserve.serving.model.tables import TABLE_PREFIX, save_slices, table_specs

from ..fusion import AdapterLayerBlock
from ..model import HEAD_TABLES, FusionModel
from ..spec import ModelSpec


def table_names(model: FusionModel) -> list[str]:
    """The live graph's table inputs, in a fixed order: each adapter site's tables, then the head's."""
    names = [
        f"{TABLE_PREFIX}blocks.{i}.{field}"
        for i, block in enumerate(model.blocks)
        if isinstance(block, AdapterLayerBlock)
        for field in AdapterLayerBlock.TABLES
    ]
    form = model.head_form()
    return names + [f"{HEAD_TABLES}{kind}{j}" for j in range(form.layers) for kind in ("w", "b")]


def task_tables(model: FusionModel, max_labels: int | None = None) -> dict[str, torch.Tensor]:
    """Every table stacked over the model's tasks (task-index order): (tasks, ...). The last head layer is zero-padded
    to ``max_labels`` rows (default: the model's widest head). Raises SpecError when a head has more labels."""
    width = model.max_labels if max_labels is None else max_labels
    tables: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        if isinstance(block, AdapterLayerBlock):
            for field in AdapterLayerBlock.TABLES:
                tables[f"{TABLE_PREFIX}blocks.{i}.{field}"] = getattr(block, field)
    form = model.head_form()
    for j in range(form.layers):
        ws, bs = [], []
        for name, head in zip(model.task_index, model.heads, strict=True):
            lin = head.linears[j]
            w, b = lin.weight.detach(), lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features)
            if j == form.layers - 1:
                if w.shape[0] > width:
                    raise SpecError(f"task '{name}' has {w.shape[0]} labels; this artifact's logits hold at most {width}")
                w = torch.cat([w, w.new_zeros(width - w.shape[0], w.shape[1])])
                b = torch.cat([b, b.new_zeros(width - b.shape[0])])
            ws.append(w)
            bs.append(b)
        tables[f"{HEAD_TABLES}w{j}"] = torch.stack(ws)  # (tasks, out, in)
        tables[f"{HEAD_TABLES}b{j}"] = torch.stack(bs)  # (tasks, out)
    return tables


def task_slices(tables: dict[str, torch.Tensor], index: int) -> dict[str, np.ndarray]:
    """Task ``index``'s slice of every table, as numpy (what one task file holds)."""
    return {name: t[index].detach().cpu().numpy().copy() for name, t in tables.items()}


class LiveGraph(nn.Module):
    """The model with its tables as inputs, for the ONNX tracer: (ids, mask, types, task_id, *tables) -> outputs."""

    def __init__(self, model: FusionModel, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        task_id: torch.Tensor,
        *tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, attention_mask, token_type_ids, task_id, dict(zip(self.names, tables, strict=True)))


def graph_tables(
    model: FusionModel, specs: dict[str, tuple[type, tuple[int, ...]]], max_labels: int | None = None
) -> list[dict[str, np.ndarray]]:
    """Per task (task-index order), its slices of every table the graph reads, in the graph's dtypes."""
    tables = task_tables(model, max_labels)
    out = []
    for i in range(len(model.task_index)):
        slices = task_slices(tables, i)
        out.append({name: np.asarray(slices[name], dtype=dtype) for name, (dtype, _) in specs.items()})
    return out


def task_record(model: FusionModel, name: str, index: int, file: str, digest: str, source: dict[str, Any]) -> dict[str, Any]:
    """A task's entry in a revision document (the manifest's task fields, plus its file and where it came from)."""
    info = model.infos[name]
    return {
        "index": index,
        "kind": info.kind,
        "labels": list(info.labels),
        "adapters": list(info.adapters),
        "adapters_per_layer": [list(layer) for layer in info.adapters_per_layer],
        "file": file,
        "sha256": digest,
        "source": source,
    }


def write_task_file(folder: Path, name: str, slices: dict[str, np.ndarray]) -> tuple[str, str]:
    """Save one task's slices under tasks/, named by its content; (path relative to ``folder``, sha256)."""
    (folder / TASK_FILES).mkdir(exist_ok=True)
    tmp = folder / TASK_FILES / f".{name}.new.npz"
    save_slices(tmp, slices)
    digest = sha256(tmp)
    final = folder / TASK_FILES / f"{name}.{digest[:12]}.npz"
    rename_durable(tmp, final)  # on disk, its name too, before any revision names it
    return f"{TASK_FILES}/{final.name}", digest


def write_first_revision(
    folder: Path, spec: ModelSpec, model: FusionModel, session: Any, checks: dict[str, Any]
) -> dict[str, Any]:
    """Revision 0 of a live export (``session``: the graph's): every task's file, the revision document, the pointer;
    returns the manifest's 'live' record (the tables, the one head form, the logits' width)."""
    specs = table_specs(session)
    tasks = {}
    for (name, index), slices in zip(model.task_index.items(), graph_tables(model, specs), strict=True):
        file, digest = write_task_file(folder, name, slices)
        tasks[name] = task_record(model, name, index, file, digest, source_of(spec, name))
    doc = {"revision": 0, "parent": None, "change": {"op": "export"}, "tasks": tasks, "checks": {"parity": checks}}
    revisions.write(folder, doc)
    revisions.publish(folder, 0)
    return {"tables": list(specs), "head_form": asdict(model.head_form()), "logits_width": model.max_labels}


def source_of(spec: ModelSpec, name: str) -> dict[str, Any]:
    """Where a task's checkpoints came from (recorded, for `tasks list` and for people)."""
    t = spec.tasks[name]
    out: dict[str, Any] = {"head": str(t.head)}
    if t.fusion is not None:
        out["fusion"] = str(t.fusion)
    if t.adapter is not None:
        out["adapter"] = t.adapter
    return out
