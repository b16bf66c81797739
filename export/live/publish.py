"""The torch-free half of ``fusionserve tasks``: a live artifact's revision checked and published, and ``tasks remove``,
which needs nothing more. Removing a task folds nothing: the other tasks' tables close up and must answer bit for bit
as before, which ONNX Runtime checks on the artifact's own graph (``tasks.py`` adds and replaces tasks, with PyTorch).
Nothing here imports torch: ``fusionserve tasks remove`` does not wait for it (tests/test_live_tasks.py runs it with
torch made unimportable)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import FusionServeError
from fusionserve.serving.model import revisions
from fusionserve.serving.model.artifact import Artifact, load_artifact
from fusionserve.serving.model.runtime import make_session
from fusionserve.serving.model.tables import TaskTables, table_specs

from ..grid import grid_inputs

MIXED_ROWS = 16  # rows of the batches that mix a new task with others, and of the unchanged tasks' check


class TasksError(FusionServeError):
    """A ``tasks`` command refused: the artifact is not live, the name is taken or unknown, a check failed."""


def live_artifact(folder: Path) -> Artifact:
    """The live artifact in ``folder``, checked (its files against the manifest). Raises TasksError if it is not live,
    ArtifactError."""
    art = load_artifact(folder)
    if art.revision is None:
        raise TasksError(
            f"{folder}: not a live artifact (its tasks are baked into {art.model_path.name}); export it again with --live"
        )
    return art


def run_tables(
    session: Any, feeds: dict[str, np.ndarray], task_id: np.ndarray, tables: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """One run of the graph on ``feeds`` with the task tables ``tables`` (rows picked by ``task_id``): its outputs by
    name."""
    wanted = {i.name for i in session.get_inputs()}
    feed = {k: v for k, v in {**feeds, "task_id": task_id}.items() if k in wanted}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {**feed, **tables}), strict=True))


def check_others(
    session: Any, art: Artifact, old: dict[str, np.ndarray], new: dict[str, np.ndarray], moved: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """Every unchanged task (name -> (old index, new index)) keeps its tables byte for byte, and answers bit for bit as
    before: batches of ``MIXED_ROWS`` rows over the unchanged tasks, all of them across the batches, at each grid
    length, before and after. Raises TasksError naming the first task that changed."""
    if not moved:
        return {"tasks": 0, "identical": True}
    for name, (i, j) in moved.items():
        if not all(np.array_equal(old[k][i], new[k][j]) for k in old):
            raise TasksError(f"task '{name}' would change (its tables differ); nothing published")
    names = list(moved)
    vocab = int(art.manifest["base_model"]["vocab_size"])
    cases = grid_inputs(vocab, art.max_seq_len, seed=2, batch_sizes=(MIXED_ROWS,))
    runs = 0
    for start in range(0, len(names), MIXED_ROWS * len(cases)):
        for c, (_, seq, feeds) in enumerate(cases):
            chunk = names[start + c * MIXED_ROWS : start + (c + 1) * MIXED_ROWS] or names[:MIXED_ROWS]
            rows = [chunk[r % len(chunk)] for r in range(MIXED_ROWS)]
            before = run_tables(session, feeds, np.array([moved[n][0] for n in rows]), old)
            after = run_tables(session, feeds, np.array([moved[n][1] for n in rows]), new)
            runs += 2
            for what in before:  # logits, fusion_activations, and token_logits where the graph has them
                same = np.all(before[what] == after[what], axis=tuple(range(1, before[what].ndim)))
                if not same.all():
                    bad = rows[int(np.argmin(same))]
                    raise TasksError(f"task '{bad}' would answer differently ({what}, sequence {seq}); nothing published")
    return {"tasks": len(names), "runs": runs, "identical": True}


def publish(folder: Path, art: Artifact, tasks: dict[str, Any], change: dict[str, Any], checks: dict[str, Any]) -> dict[str, Any]:
    """Write the revision after the newest one written (published or not), then move the pointer to it."""
    number = max([*revisions.numbers(folder), art.revision or 0]) + 1
    doc = {"revision": number, "parent": art.revision, "change": change, "tasks": tasks, "checks": checks}
    revisions.write(folder, doc)
    revisions.publish(folder, number)
    return revisions.read(folder, number)


def task_entries(folder: Path, art: Artifact) -> dict[str, Any]:
    """The published revision's task entries."""
    return dict(revisions.read(folder, art.revision or 0)["tasks"])


def remove_task(folder: str | Path, name: str) -> dict[str, Any]:
    """Remove task ``name`` from a live artifact as a new published revision; returns its document. The other tasks
    keep their order (their indices close up) and are checked unchanged. Raises TasksError (unknown task, the last
    task), ArtifactError or RevisionError."""
    folder = Path(folder).resolve()
    started = time.perf_counter()
    with revisions.TasksLock(folder):
        art = live_artifact(folder)
        if name not in art.tasks:
            raise TasksError(f"no task '{name}' to remove; tasks: {', '.join(art.tasks)}")
        if len(art.tasks) == 1:
            raise TasksError(f"task '{name}' is the artifact's last task; an artifact serves at least one")
        session = make_session(art.model_path, spin=False, device="cpu")  # no busy-waiting beside torch
        specs = table_specs(session)
        old = TaskTables(folder, specs, verify=False).load(art)
        order = [n for n in sorted(art.tasks, key=lambda n: art.tasks[n].index) if n != name]
        keep = [art.tasks[n].index for n in order]
        new = {k: np.ascontiguousarray(v[keep]) for k, v in old.items()}
        moved = {n: (art.tasks[n].index, i) for i, n in enumerate(order)}
        others = check_others(session, art, old, new, moved)
        entries = task_entries(folder, art)
        tasks = {n: {**entries[n], "index": i} for i, n in enumerate(order)}
        change = {"op": "remove", "task": name, "seconds": round(time.perf_counter() - started, 2)}
        return publish(folder, art, tasks, change, {"others": others})
