"""A live artifact's revisions: which tasks it serves now, and every set of tasks it served before.

    tasks/<task>.<sha256[:12]>.npz      one task's tables (serving/model/tables.py); never changed once written
    revisions/000007.json               revision 7: its tasks (index, kind, labels, adapters, file, sha256), the change
                                        that made it, the checks it passed, its parent
    revisions/CURRENT                   the revision served: "7"
    revisions/lock                      held by the one ``fusionserve tasks`` command that may run at a time

Every file is written under a temporary name, synced, then renamed into place, and CURRENT last: a reader sees the
old revision or the new one, never half of one, and a crash before CURRENT moves leaves the old one served (an
unpublished revision file is harmless; the next command numbers past it). Servers poll CURRENT's stat (one
``os.stat`` a poll) and load a revision when it changes. Nodes that do not share the folder get a revision through
Ray Serve instead: ``bundle`` makes it a deployment ``user_config``, which each replica's ``reconfigure`` hands to
``install``. No torch here.
"""

from __future__ import annotations

import base64
import datetime as dt
import fcntl
import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from fusionserve.errors import FusionServeError

from .files import write_atomic

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
    _check(doc, number, str(path))
    return doc


def _check(doc: Any, number: int, where: str) -> None:
    """Raise RevisionError naming ``where`` and the field unless ``doc`` is revision ``number``'s document, every task
    with its 'file' (one file in the artifact's tasks/ folder, as the manifest's files are confined to the artifact's
    own) and its 'sha256'."""
    if not isinstance(doc, dict) or doc.get("revision") != number:
        raise RevisionError(f"{where}: field 'revision' must be {number}")
    tasks = doc.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise RevisionError(f"{where}: field 'tasks' must name at least one task")
    for name, t in tasks.items():
        if not isinstance(t, dict) or not all(isinstance(t.get(k), str) for k in ("file", "sha256")):
            raise RevisionError(f"{where}: field 'tasks.{name}' must give its 'file' and 'sha256'")
        parts = PurePosixPath(t["file"]).parts
        if len(parts) != 2 or parts[0] != TASK_FILES or parts[1] in (".", "..") or "\\" in t["file"]:
            raise RevisionError(
                f"{where}: field 'tasks.{name}.file' = {t['file']!r:.80}: must be a file in the artifact's {TASK_FILES}/ folder"
            )


def numbers(folder: Path) -> list[int]:
    """Every revision written, published or not, in order."""
    return sorted(int(p.stem) for p in (folder / REVISIONS).glob("[0-9]*.json") if p.stem.isdigit())


def write(folder: Path, doc: dict[str, Any]) -> Path:
    """Write revision ``doc['revision']`` (not yet served: see ``publish``); returns its path."""
    (folder / REVISIONS).mkdir(exist_ok=True)
    doc = {**doc, "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = revision_path(folder, int(doc["revision"]))
    write_atomic(path, (json.dumps(doc, indent=2) + "\n").encode())
    return path


def publish(folder: Path, number: int) -> None:
    """Make revision ``number`` the one served: the pointer moves atomically."""
    write_atomic(folder / REVISIONS / POINTER, f"{number}\n".encode())


class TasksLock:
    """The one ``fusionserve tasks`` command (or replica installing a revision) allowed at a time on an artifact (an
    flock on revisions/lock, released by the kernel if the process dies). Raises RevisionError at once when another
    holds it, unless ``wait`` (then it waits for it: a replica's ``install``)."""

    def __init__(self, folder: Path, wait: bool = False) -> None:
        self.path = folder / REVISIONS / _LOCK
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> TasksLock:
        if not self.path.parent.parent.is_dir():
            raise RevisionError(f"{self.path.parent.parent}: no such artifact folder")
        self.path.parent.mkdir(exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
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


def bundle(folder: Path, since: int = 0) -> dict[str, Any]:
    """The published revision as a Serve ``user_config`` (``fusionserve tasks config``), for nodes that do not share the
    folder: its document and every task file that revision ``since`` (what the nodes were shipped with) lacks, base64."""
    number = current(folder)
    doc, old = read(folder, number), read(folder, since)
    have = {t["file"] for t in old["tasks"].values()}
    names = [revision_path(folder, number).relative_to(folder).as_posix()]
    names += sorted({t["file"] for t in doc["tasks"].values()} - have)
    return {"revision": number, "files": {n: base64.b64encode((folder / n).read_bytes()).decode() for n in names}}


def install(folder: Path, config: dict[str, Any]) -> int:
    """Write a ``bundle`` into this node's copy of the artifact (each task file checked against the revision's sha256)
    and publish it here when it is newer than what the node serves; returns its number. Under the artifact's lock
    (waiting for it): replicas of one node installing at once never publish out of order. Raises RevisionError naming
    the field or file that is wrong; nothing is published then."""
    number = config.get("revision")
    files = config.get("files")
    if not isinstance(number, int) or not isinstance(files, dict):
        raise RevisionError(
            "user_config: needs 'revision' (an int) and 'files' (path -> base64), as `fusionserve tasks config` writes"
        )
    name = revision_path(folder, number).relative_to(folder).as_posix()
    try:
        blobs = {n: base64.b64decode(v, validate=True) for n, v in files.items()}
        doc = json.loads(blobs[name])
    except (KeyError, ValueError, TypeError) as exc:
        raise RevisionError(f"user_config: field 'files' must hold {name} and base64 task files ({exc})") from None
    _check(doc, number, f"user_config: files.{name}")  # before anything is written where the document says
    with TasksLock(folder, wait=True):
        for task, t in doc["tasks"].items():
            path = folder / t["file"]
            data = blobs.get(t["file"]) if not path.is_file() else None
            if not path.is_file() and data is None:
                raise RevisionError(f"user_config: task '{task}' needs {t['file']}, which neither this node nor 'files' has")
            if data is not None:
                if hashlib.sha256(data).hexdigest() != t["sha256"]:
                    raise RevisionError(f"user_config: files.{t['file']}: checksum differs from revision {number}'s")
                (folder / TASK_FILES).mkdir(exist_ok=True)
                write_atomic(path, data)
        write_atomic(folder / name, blobs[name])
        if not is_live(folder) or current(folder) < number:
            publish(folder, number)
    return number
