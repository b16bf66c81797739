"""``fusionserve tasks add``: add or replace a target task of a live artifact (``export --live``) without re-tracing
anything: the graph stays as it is and only the task tables beside it change (``tables.py``). ``tasks remove`` and
what every change shares (the unchanged tasks' check, publishing) need no torch: ``publish.py``.

A new or retrained task is folded over the artifact's own adapter stacks, from AdapterHub checkpoints and the
export's base model and adapters (found through the spec the manifest records, checked against the manifest's
checksums). Before a revision is published it passes two checks on the artifact's own graph:

- the task itself against the PyTorch reference (the export's parity gate for its precision; for int8 its label
  agreement and probability gate), alone over the shape grid and in batches mixing it with every other task;
- every other task unchanged: a batch of all of them answers bit for bit as it did on the revision before.

Then the task file, the revision document and last the pointer are written (``serving/model/revisions.py``), all under
one lock: a refusal or a crash leaves the served revision as it was.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fusionserve.serving.model import revisions
from fusionserve.serving.model.artifact import Artifact, sha256
from fusionserve.serving.model.runtime import make_session
from fusionserve.serving.model.tables import TaskTables, check_slices, table_specs

from ..bf16 import Bf16Gate
from ..build import build_model
from ..checkpoint import load_fusion
from ..grid import grid_inputs
from ..int8.gate import GateReport, Int8Gate
from ..model import OUTPUT, FusionModel
from ..spec import ModelSpec, TaskSpec, load_spec
from ..validate import max_diff, tolerances
from .publish import MIXED_ROWS, TasksError, check_others, live_artifact, publish, run_tables, task_entries
from .tables import graph_tables, live_heads, source_of, task_record, write_task_file

_FEEDS = ("input_ids", "attention_mask", "token_type_ids")


def _spec(art: Artifact, spec_path: str | Path | None) -> ModelSpec:
    """The export's spec (or ``spec_path``), the adapters the artifact serves checked against the manifest's
    checksums (the base model is not hashed: a different one fails the new task's parity gate). Raises TasksError
    naming the file that differs or is missing."""
    sources = art.manifest["sources"]
    path = Path(spec_path or sources["spec"]["path"])
    if not path.is_file():
        raise TasksError(
            f"{art.folder}/manifest.json: field 'sources.spec.path' = {str(path)!r}: no such file; the base model and "
            "adapters of the export are needed to fold a task: pass --spec with the export's spec"
        )
    spec = load_spec(path)
    lacking = [a for a in art.adapters if a not in spec.adapters]
    if lacking:
        raise TasksError(f"{path}: lacks adapter(s) {lacking} that the artifact serves; pass the export's spec")
    root = spec.path.parent
    folders = [spec.adapters[a] for a in art.adapters]
    recorded = sources["files"]
    for folder in folders:
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = str(f.relative_to(root)) if f.is_relative_to(root) else str(f)
            if name in recorded and sha256(f) != recorded[name]:
                raise TasksError(f"{f}: differs from the file the artifact was exported from (manifest 'sources.files')")
    return spec


def _reference(art: Artifact, spec: ModelSpec, task: TaskSpec, src: TaskSpec) -> FusionModel:
    """The task alone, folded over the artifact's stacks: its tables and its PyTorch reference, built from ``src``
    (``task`` with absolute paths; messages name the paths as given). Raises SpecError / CheckpointError / TasksError
    for checkpoints that do not fit the artifact."""
    if task.fusion is not None:
        missing = [a for a in load_fusion(task.fusion).adapter_names if a not in art.adapters]
        if missing:
            raise TasksError(
                f"{task.fusion}/adapter_fusion_config.json: field 'adapter_names' names adapter(s) {missing} that the "
                f"artifact lacks (it holds: {', '.join(art.adapters)})"
            )
    if task.adapter is not None and task.adapter not in art.adapters:
        raise TasksError(f"--adapter {task.adapter!r}: the artifact lacks it (it holds: {', '.join(art.adapters)})")
    model = build_model(replace(spec, tasks={task.name: src}), stacks=(art.adapters, art.manifest["adapters_per_layer"]))
    info = model.infos[task.name]
    level = info.level
    if level not in (heads := live_heads(art.manifest["live"])):
        raise TasksError(
            f"{task.head}/head_config.json: a {info.head} head reads {'every token' if level == 'token' else 'the sequence'}"
            f" ({OUTPUT[level]}); this artifact was exported without a {level}-level head, so its graph has no place for "
            f"one: export it again with a {level}-level task among its tasks"
        )
    (want, width), form = heads[level], model.head_form(level)
    if form != want:
        raise TasksError(
            f"{task.head}/head_config.json: the head has {form.describe()}; this artifact's {level}-level heads have "
            f"{want.describe()}"
        )
    labels = len(info.labels)
    if labels > width:
        raise TasksError(
            f"{task.head}/head_config.json: field 'config.num_labels' = {labels}: this artifact's {OUTPUT[level]} hold at "
            f"most {width} labels"
        )
    return model


def _gate_session(art: Artifact, session: Any) -> Any:
    """The session a new task's answers are gated on: the artifact's graph as served (a bf16 artifact's: OpenVINO in
    bf16), else ``session`` (ONNX Runtime's, which reads the tables and checks the other tasks)."""
    if art.manifest["precision"] != "bf16":
        return session
    from fusionserve.serving.model.openvino_runtime import compile_graph

    return compile_graph(art.model_path, "bf16", cache=False)


def _gate_new(
    session: Any, model: FusionModel, art: Artifact, tables: dict[str, np.ndarray], index: int, n_tasks: int
) -> dict[str, Any]:
    """The new task against its PyTorch reference: alone over the grid, and its rows in batches mixing every task; for
    int8 what a caller reads of its head kind (``int8.gate.distributions``). Raises TasksError with the worst figures
    when it fails the artifact precision's gate."""
    precision = art.manifest["precision"]
    name = next(iter(model.task_index))  # the model holds this one task
    info = model.infos[name]
    out, labels = OUTPUT[info.level], len(info.labels)
    vocab, max_len = model.backbone.vocab_size, art.max_seq_len
    runs = [(np.array([index]), case, None) for case in grid_inputs(vocab, max_len)]
    runs += [(ids, case, ids == index) for ids, case in _mixed(vocab, max_len, index, n_tasks)]
    worst = {out: 0.0, "fusion_activations": 0.0}
    int8 = GateReport(Int8Gate(**art.manifest["int8"]["gate"]["thresholds"]) if precision == "int8" else Int8Gate())
    for task_id, (_, seq, feeds), pick in runs:
        got = run_tables(session, feeds, task_id, tables)
        sel = slice(None) if pick is None else pick  # the reference runs the new task's rows only
        with torch.inference_mode():
            ref = model(*(torch.from_numpy(feeds[k][sel]) for k in _FEEDS), torch.zeros(1, dtype=torch.long))
        want = {k: v.numpy() for k, v in zip(model.outputs, ref, strict=True)}
        real = feeds["attention_mask"][sel] == 1  # (rows, seq)
        a, b = got[out][sel][..., :labels], want[out][..., :labels]
        worst[out] = max(worst[out], max_diff(a, b, real[:, :, None] if info.level == "token" else np.True_))
        acts = max_diff(got["fusion_activations"][sel], want["fusion_activations"], real[:, None, :, None])
        worst["fusion_activations"] = max(worst["fusion_activations"], acts)
        int8.add(info.head, b, a, real, f"sequence {seq}")
    report = {"precision": precision, "head": info.head, "cases": len(runs), "max_abs_diff": worst, **_agreement(int8)}
    if precision == "int8":
        report["gate"] = asdict(int8.gate)
        ok = not int8.failures()
    elif precision == "bf16":  # run by OpenVINO in bf16 (``bf16_session``): the export's gate, against PyTorch
        bf16 = Bf16Gate(**art.manifest["bf16"]["gate"]["thresholds"])
        report["gate"] = {"min_label_agreement": bf16.min_label_agreement, "max_logit_change": bf16.max_logit_change}
        agreement = [report[k] for k in ("label_agreement", "correlation") if k in report]
        ok = all(a >= bf16.min_label_agreement for a in agreement) and worst[out] <= bf16.max_logit_change
    else:
        report["tolerance"] = tolerances(precision, (out, "fusion_activations"))
        ok = all(limit is None or worst[k] <= limit for k, limit in report["tolerance"].items())
    if not ok:
        raise TasksError(
            f"task '{name}' does not match its PyTorch reference on the "
            f"artifact's graph ({precision}); nothing published: {json.dumps(report)}"
        )
    return report


def _agreement(report: GateReport) -> dict[str, Any]:
    """The one head's agreement figures of ``report``: label agreement and probability change (its kind's units), or a
    regression's correlation."""
    if not report.heads:
        return {"label_agreement": report.label_agreement, "max_probability_change": report.max_probability_change}
    kind, figures = next(iter(report.heads.items()))
    if kind == "regression":
        return {"correlation": figures.correlation}
    return {"label_agreement": figures.agreement, "max_probability_change": figures.max_probability_change}


def _mixed(vocab: int, max_len: int, index: int, n_tasks: int) -> list[tuple[np.ndarray, Any]]:
    """Batches of ``MIXED_ROWS`` rows, every other one the new task's and the rest cycling through up to
    ``MIXED_ROWS // 2`` other tasks, at each grid length: bounded whatever the number of tasks."""
    others = [i for i in range(n_tasks) if i != index][: MIXED_ROWS // 2] or [index]
    ids = np.array([index if r % 2 == 0 else others[(r // 2) % len(others)] for r in range(MIXED_ROWS)], dtype=np.int64)
    return [(ids, case) for case in grid_inputs(vocab, max_len, seed=1, batch_sizes=(MIXED_ROWS,))]


def add_task(
    folder: str | Path, task: TaskSpec, replace_existing: bool = False, spec_path: str | Path | None = None
) -> dict[str, Any]:
    """Add ``task`` to a live artifact (or, with ``replace_existing``, swap the weights of the task of that name), as a
    new published revision; returns its document. Raises TasksError, SpecError, CheckpointError, ArtifactError,
    RevisionError or TableError; nothing is published then."""
    folder = Path(folder).resolve()
    started = time.perf_counter()
    with revisions.TasksLock(folder):
        art = live_artifact(folder)
        taken = task.name in art.tasks
        if taken and not replace_existing:
            raise TasksError(f"task '{task.name}' exists (revision {art.revision}); pass --replace to swap its weights")
        if replace_existing and not taken:
            raise TasksError(f"--replace: no task '{task.name}' to replace; tasks: {', '.join(art.tasks)}")
        spec = _spec(art, spec_path)
        src = replace(task, head=task.head.resolve(), fusion=task.fusion.resolve() if task.fusion else None)
        model = _reference(art, spec, task, src)
        session = make_session(art.model_path, spin=False, device="cpu")  # no busy-waiting beside torch
        specs = table_specs(session)
        slices = graph_tables(model, specs, live_heads(art.manifest["live"]))[0]
        check_slices(slices, specs, f"task '{task.name}'")
        old = TaskTables(folder, specs, verify=False).load(art)  # served files: each server checks them as it loads
        order = sorted(art.tasks, key=lambda n: art.tasks[n].index)
        index = art.tasks[task.name].index if taken else len(order)
        new = {k: np.concatenate([v, slices[k][None]]) if not taken else v.copy() for k, v in old.items()}
        if taken:
            for k in new:
                new[k][index] = slices[k]
        gate = _gate_new(_gate_session(art, session), model, art, new, index, len(order) + (not taken))
        moved = {n: (art.tasks[n].index, art.tasks[n].index) for n in order if n != task.name}
        others = check_others(session, art, old, new, moved)
        file, digest = write_task_file(folder, task.name, slices)
        record = task_record(model, task.name, index, file, digest, source_of(replace(spec, tasks={task.name: src}), task.name))
        tasks = {**task_entries(folder, art), task.name: record}
        change = {"op": "replace" if taken else "add", "task": task.name, "seconds": round(time.perf_counter() - started, 2)}
        return publish(folder, art, tasks, change, {"task": gate, "others": others})
