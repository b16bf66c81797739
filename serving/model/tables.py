"""A live artifact's task tables (see export/live/tables.py): graph inputs named ``task.*`` whose first axis is the task.

One file per task holds that task's slice of every table (numpy ``.npz``, uncompressed); a revision lists its tasks'
files in task-index order, and the tables fed to the graph are those slices stacked. No torch here.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import FusionServeError

from .files import write_atomic

TABLE_PREFIX = "task."  # every table input's name starts with it
_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


class TableError(FusionServeError):
    """A task file is missing, corrupt, or does not fit the graph's tables."""


def is_table(name: str) -> bool:
    return name.startswith(TABLE_PREFIX)


def table_specs(session: Any) -> dict[str, tuple[type, tuple[int, ...]]]:
    """The session's table inputs: name -> (numpy dtype, shape of one task's slice)."""
    specs = {}
    for i in session.get_inputs():
        if is_table(i.name):
            rest = tuple(int(d) if isinstance(d, int) else -1 for d in i.shape[1:])
            specs[i.name] = (_TYPES.get(i.type, np.float32), rest)
    return specs


def check_slices(slices: Mapping[str, np.ndarray], specs: Mapping[str, tuple[type, tuple[int, ...]]], where: str) -> None:
    """Every table of ``specs`` present in ``slices`` with its shape; raises TableError naming ``where`` and the table."""
    missing = sorted(set(specs) - set(slices))
    if missing:
        raise TableError(f"{where}: no table(s) {missing[:3]} (the graph reads {len(specs)} tables)")
    for name, (_, shape) in specs.items():
        got = slices[name].shape
        if len(got) != len(shape) or any(s not in (-1, g) for s, g in zip(shape, got, strict=True)):
            raise TableError(f"{where}: table '{name}' has shape {list(got)}; the graph takes {list(shape)}")


def save_slices(path: Path, slices: Mapping[str, np.ndarray]) -> None:
    """Write one task's slices to ``path`` whole, synced to disk with its folder (serving/model/files.py)."""
    write_atomic(path, lambda fh: np.savez(fh, **dict(slices)))


def load_slices(path: Path, digest: str | None = None) -> dict[str, np.ndarray]:
    """One task file's slices, checked against ``digest`` (its sha256) when given; raises TableError naming the file
    when it is missing, changed, or not a readable .npz."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TableError(f"{path}: task file missing") from None
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise TableError(f"{path}: checksum differs from its revision's 'sha256'; the file was changed or cut short")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise TableError(f"{path}: not a readable task file ({exc})") from None


def stack(
    per_task: Sequence[Mapping[str, np.ndarray]], specs: Mapping[str, tuple[type, tuple[int, ...]]]
) -> dict[str, np.ndarray]:
    """The graph's feeds: each table's slices stacked in task-index order, in the graph's dtype."""
    return {
        name: np.ascontiguousarray(np.stack([np.asarray(t[name], dtype=dtype) for t in per_task]))
        for name, (dtype, _) in specs.items()
    }


class WithTables:
    """An InferenceSession that always feeds ``tables``, and lists only the other inputs: hands a live graph to code
    written for the baked one (the parity and int8 gates)."""

    def __init__(self, session: Any, tables: Mapping[str, np.ndarray]) -> None:
        self.session, self.tables = session, dict(tables)

    def like(self, session: Any) -> WithTables:
        """Another session of the same graph (its int8 form), fed the same tables."""
        return WithTables(session, self.tables)

    def get_inputs(self) -> list[Any]:
        return [i for i in self.session.get_inputs() if not is_table(i.name)]

    def get_outputs(self) -> list[Any]:
        return self.session.get_outputs()

    def run(self, names: Any, feeds: Mapping[str, np.ndarray]) -> Any:
        return self.session.run(names, {**feeds, **self.tables})


class TaskTables:
    """Loads a revision's stacked tables. A task the previous revision had (same file checksum) is taken from that
    revision's stack, so only new task files are read, and no copy of any task is kept beyond the stacks being served
    (memory: one stack per revision still answering requests)."""

    def __init__(self, folder: Path, specs: Mapping[str, tuple[type, tuple[int, ...]]], verify: bool = True) -> None:
        self.folder, self.specs, self.verify = folder, dict(specs), verify
        self._last: tuple[dict[str, np.ndarray], dict[str, int]] = ({}, {})  # the last stack, and digest -> its row

    def load(self, artifact: Any) -> dict[str, np.ndarray]:
        """The feeds for ``artifact`` (a serving.artifact.Artifact at some revision): {} for a graph without tables.
        Raises TableError for a missing, changed or unfitting task file, or a live graph without revisions."""
        if not self.specs:
            return {}
        if not artifact.task_files:
            raise TableError(f"{self.folder}: the graph takes task tables but the artifact has no revisions/CURRENT")
        order = sorted(artifact.tasks.values(), key=lambda t: t.index)
        last, rows = self._last
        per_task: list[Mapping[str, np.ndarray]] = []
        for entry in order:
            file, digest = artifact.task_files[entry.name]
            if digest in rows:
                per_task.append({k: v[rows[digest]] for k, v in last.items()})  # views into the last stack
                continue
            path = self.folder / file
            slices = load_slices(path, digest if self.verify else None)
            check_slices(slices, self.specs, str(path))
            per_task.append(slices)
        stacked = stack(per_task, self.specs)
        self._last = (stacked, {artifact.task_files[e.name][1]: i for i, e in enumerate(order)})
        return stacked
