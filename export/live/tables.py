"""Live tasks, the torch side: every per-task tensor of the model (each adapter site's folded fusion matrices, mask,
gate and query switch; each head's weights) as a *graph input* stacked over tasks, so that the served graph holds
only what all tasks share (backbone, adapter down-projections) and a task is a few small arrays beside it.

The graph gathers each row's slice of every table by ``task_id``, exactly as the baked multi-task graph gathers its
initializers; only where the tables come from changes. The tables' first axis is symbolic ("tasks"): a revision with
more or fewer tasks feeds longer or shorter tables to the same graph, with no re-trace and no new session
(``fusionserve tasks``, ``tasks.py``; serving side: ``serving/model/tables.py``, ``serving/model/revisions.py``).

Heads are stacked too, per level: the sequence-level heads (classification, regression, multiple choice) in one set of
tables feeding ``logits``, the token-level heads (tagging, question answering) in another feeding ``token_logits``. Every
head of one level has one form (layers, activation, pooler: ``model.HeadForm``) and its outputs are zero-padded to
that level's width; a task has a slot in both sets, zeros in the level its head is not of.
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
from ..model import HEAD_TABLES, LEVELS, FusionModel, HeadForm
from ..spec import ModelSpec


def table_names(model: FusionModel) -> list[str]:
    """The live graph's table inputs, in a fixed order: each adapter site's tables, then the heads' of each level some
    task has."""
    names = [
        f"{TABLE_PREFIX}blocks.{i}.{field}"
        for i, block in enumerate(model.blocks)
        if isinstance(block, AdapterLayerBlock)
        for field in AdapterLayerBlock.TABLES
    ]
    for level in (lv for lv in LEVELS if model.levels[lv]):
        form = model.head_form(level)
        names += [f"{HEAD_TABLES[level]}{kind}{j}" for j in range(form.layers) for kind in ("w", "b")]
    return names


def model_heads(model: FusionModel) -> dict[str, tuple[HeadForm, int]]:
    """Per level some task of ``model`` has, its one head form and the widest head's labels."""
    widths = {"sequence": model.max_labels, "token": model.token_width}
    return {level: (model.head_form(level), widths[level]) for level in LEVELS if model.levels[level]}


def live_heads(live: dict[str, Any]) -> dict[str, tuple[HeadForm, int]]:
    """Per level a live artifact has head tables of, their head form and output width (its manifest's 'live' record;
    a record written before token-level heads describes the sequence level only)."""
    keys = {"sequence": ("head_form", "logits_width"), "token": ("token_head_form", "token_logits_width")}
    return {level: (HeadForm(**live[form]), int(live[width])) for level, (form, width) in keys.items() if form in live}


def task_tables(model: FusionModel, heads: dict[str, tuple[HeadForm, int]] | None = None) -> dict[str, torch.Tensor]:
    """Every table stacked over the model's tasks (task-index order): (tasks, ...). ``heads``: per level the graph has
    head tables of, their form and width (default: the model's own, ``model_heads``); a head's last layer is zero-padded
    to its level's width, and a task has zeros in the level its head is not of. Raises SpecError when a head has more
    labels than its level's width."""
    tables: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        if isinstance(block, AdapterLayerBlock):
            for field in AdapterLayerBlock.TABLES:
                tables[f"{TABLE_PREFIX}blocks.{i}.{field}"] = getattr(block, field)
    for level, (form, width) in (model_heads(model) if heads is None else heads).items():
        tables |= _head_tables(model, level, form.layers, width)
    return tables


def _head_tables(model: FusionModel, level: str, layers: int, width: int) -> dict[str, torch.Tensor]:
    hidden, names = model.backbone.hidden_size, list(model.task_index)
    tables = {}
    for j in range(layers):
        out = width if j == layers - 1 else hidden
        ws, bs = torch.zeros(len(names), out, hidden), torch.zeros(len(names), out)
        for i in model.levels[level]:
            lin = model.heads[i].linears[j]
            if lin.out_features > out:
                raise SpecError(
                    f"task '{names[i]}' has {lin.out_features} labels; this artifact's {level}-level heads hold at most {out}"
                )
            ws[i, : lin.out_features] = lin.weight.detach()
            if lin.bias is not None:
                bs[i, : lin.out_features] = lin.bias.detach()
        tables[f"{HEAD_TABLES[level]}w{j}"] = ws  # (tasks, out, in)
        tables[f"{HEAD_TABLES[level]}b{j}"] = bs  # (tasks, out)
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
    ) -> tuple[torch.Tensor, ...]:
        return self.model(input_ids, attention_mask, token_type_ids, task_id, dict(zip(self.names, tables, strict=True)))


def graph_tables(
    model: FusionModel, specs: dict[str, tuple[type, tuple[int, ...]]], heads: dict[str, tuple[HeadForm, int]] | None = None
) -> list[dict[str, np.ndarray]]:
    """Per task (task-index order), its slices of every table the graph reads, in the graph's dtypes (``heads``: see
    ``task_tables``)."""
    tables = task_tables(model, heads)
    out = []
    for i in range(len(model.task_index)):
        slices = task_slices(tables, i)
        out.append({name: np.asarray(slices[name], dtype=dtype) for name, (dtype, _) in specs.items()})
    return out


def live_record(model: FusionModel, tables: list[str]) -> dict[str, Any]:
    """The manifest's 'live' record: the graph's tables, and per level some task has, the one head form and the output's
    width that a task added later must fit (a level no task has at export has no tables: its heads cannot be added)."""
    record: dict[str, Any] = {"tables": tables}
    heads = model_heads(model)
    if "sequence" in heads:
        record |= {"head_form": asdict(heads["sequence"][0]), "logits_width": heads["sequence"][1]}
    if "token" in heads:
        record |= {"token_head_form": asdict(heads["token"][0]), "token_logits_width": heads["token"][1]}
    return record


def task_record(model: FusionModel, name: str, index: int, file: str, digest: str, source: dict[str, Any]) -> dict[str, Any]:
    """A task's entry in a revision document (the manifest's task fields, plus its file and where it came from)."""
    return {"index": index, **model.infos[name].manifest_entry(), "file": file, "sha256": digest, "source": source}


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
    returns the manifest's 'live' record (``live_record``)."""
    specs = table_specs(session)
    tasks = {}
    for (name, index), slices in zip(model.task_index.items(), graph_tables(model, specs), strict=True):
        file, digest = write_task_file(folder, name, slices)
        tasks[name] = task_record(model, name, index, file, digest, source_of(spec, name))
    doc = {"revision": 0, "parent": None, "change": {"op": "export"}, "tasks": tasks, "checks": {"parity": checks}}
    revisions.write(folder, doc)
    revisions.publish(folder, 0)
    return live_record(model, list(specs))


def source_of(spec: ModelSpec, name: str) -> dict[str, Any]:
    """Where a task's checkpoints came from (recorded, for `tasks list` and for people)."""
    t = spec.tasks[name]
    out: dict[str, Any] = {"head": str(t.head)}
    if t.fusion is not None:
        out["fusion"] = str(t.fusion)
    if t.adapter is not None:
        out["adapter"] = t.adapter
    return out
