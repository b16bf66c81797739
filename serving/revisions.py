"""A live artifact's revisions: which tasks it serves now, and every set of tasks it served before.

    tasks/<task>.<sha256[:12]>.npz      one task's tables (serving/tables.py); never changed once written
    revisions/000007.json               revision 7: its tasks (index, kind, labels, adapters, file, sha256), the change
                                        that made it, the checks it passed, its parent
    revisions/CURRENT                   the revision served: "7"
    revisions/lock                      held by the one ``fusionserve tasks`` command that may run at a time

Every file is written under a temporary name, synced, then renamed into place, and CURRENT last: a reader sees the
old revision or the new one, never half of one, and a crash before CURRENT moves leaves the old one served (an
unpublished revision file is harmless; the next command numbers past it). Servers poll CURRENT's stat (one
``os.stat`` a poll) and load a revision when it changes. No torch here.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from fusionserve.errors import FusionServeError

REVISIONS = "revisions"
TASK_FILES = "tasks"
POINTER = "CURRENT"
_LOCK = "lock"


class RevisionError(FusionServeError):
    """A revision file or the pointer is missing or malformed, or another ``tasks`` command holds the lock."""


def is_live(folder: Path) -> bool:
    """Whether the artifact has revisions (exported with ``--live``)."""
    return (folder / REVISIONS / POINTER).is_file()


def pointer_stamp(folder: Path) -> tuple[int, int, int] | None:
    """A cheap fingerprint of the pointer (one stat): changes whenever a revision is published."""
    try:
        st = os.stat(folder / REVISIONS / POINTER)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size)


def current(folder: Path) -> int:
    """The revision served; raises RevisionError naming the pointer file when it is unreadable."""
    path = folder / REVISIONS / POINTER
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError) as exc:
        raise RevisionError(f"{path}: cannot read the revision pointer ({exc})") from None
    if not text.isdigit():
        raise RevisionError(f"{path}: holds {text[:40]!r}; expected a revision number")
    return int(text)


def revision_path(folder: Path, number: int) -> Path:
    return folder / REVISIONS / f"{number:06d}.json"


def read(folder: Path, number: int) -> dict[str, Any]:
    """Revision ``number``'s document; raises RevisionError naming the file and the field that is wrong."""
    path = revision_path(folder, number)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RevisionError(f"{path}: revision {number} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RevisionError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("revision") != number:
        raise RevisionError(f"{path}: field 'revision' must be {number}")
    tasks = doc.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise RevisionError(f"{path}: field 'tasks' must name at least one task")
    for name, t in tasks.items():
        if not isinstance(t, dict) or not all(isinstance(t.get(k), str) for k in ("file", "sha256")):
            raise RevisionError(f"{path}: field 'tasks.{name}' must give its 'file' and 'sha256'")
    return doc


def numbers(folder: Path) -> list[int]:
    """Every revision written, published or not, in order."""
    return sorted(int(p.stem) for p in (folder / REVISIONS).glob("[0-9]*.json") if p.stem.isdigit())


def _write_synced(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(folder: Path, doc: dict[str, Any]) -> Path:
    """Write revision ``doc['revision']`` (not yet served: see ``publish``); returns its path."""
    (folder / REVISIONS).mkdir(exist_ok=True)
    doc = {**doc, "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = revision_path(folder, int(doc["revision"]))
    _write_synced(path, (json.dumps(doc, indent=2) + "\n").encode())
    return path


def publish(folder: Path, number: int) -> None:
    """Make revision ``number`` the one served: the pointer moves atomically."""
    _write_synced(folder / REVISIONS / POINTER, f"{number}\n".encode())


class TasksLock:
    """The one ``fusionserve tasks`` command allowed at a time on an artifact (an flock on revisions/lock, released
    by the kernel if the process dies). Raises RevisionError at once when another holds it."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / REVISIONS / _LOCK
        self._fd: int | None = None

    def __enter__(self) -> TasksLock:
        self.path.parent.mkdir(exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RevisionError(
                f"{self.path}: another `fusionserve tasks` command (pid {holder}) is changing this artifact; "
                "wait for it to finish"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
