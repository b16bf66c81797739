"""A live artifact's revisions under the faults a file system has: a replica's revision follower outlives an OSError
(EIO, ESTALE on NFS, EACCES), counting and logging it; a published revision's task files are on disk before the
pointer names them; replicas installing revisions from Serve's user_config take the artifact's lock, so none moves
the pointer back; a revision names no file outside the artifact's tasks/ folder."""

import base64
import contextlib
import errno
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fusionserve.serving.model import revisions
from fusionserve.serving.model.revisions import RevisionError


class _Stop(BaseException):
    """Ends the follower under test (not an Exception: nothing a follower should survive)."""


class _Runner:
    """A runner whose refresh() gives ``outcomes`` in turn (raising the exceptions), then False until ``done`` is set,
    then raises _Stop."""

    def __init__(self, outcomes: list) -> None:
        self.outcomes, self.done = list(outcomes), threading.Event()
        self.served = SimpleNamespace(revision=3)
        self.artifact = SimpleNamespace(tasks={"t": None})

    def refresh(self) -> bool:
        if self.done.is_set():
            raise _Stop
        if not self.outcomes:
            return False
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out


def test_the_revision_follower_survives_os_errors_and_counts_them(monkeypatch):
    """It caught only FusionServeError: an OSError ended its thread and the replica served the old revision forever,
    without a word."""
    from fusionserve.serving.api import app
    from fusionserve.serving.api.classify import log
    from fusionserve.serving.api.metrics import Metrics

    said: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: said.append(record.getMessage())  # the replica's log (Serve's, which does not propagate)
    log.addHandler(handler)

    # the globals the method reads: Serve's ingress decorator rebuilt the class from a pickled copy, whose functions
    # read a copy of the module's globals, so a setattr on the module left the poll at 0.25 s (2.5 s after a failure)
    monkeypatch.setitem(app.FusionServe._follow_revisions.__globals__, "_REVISION_POLL_S", 0.01)
    runner = _Runner([OSError(errno.EIO, "Input/output error"), OSError(errno.ESTALE, "Stale file handle"), True])
    replica = SimpleNamespace(runner=runner, stats=Metrics())

    def follow() -> None:
        with contextlib.suppress(_Stop):
            app.FusionServe._follow_revisions(replica)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    deadline = time.monotonic() + 30
    while runner.outcomes and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    try:
        assert follower.is_alive(), "the follower died"

        def loads(result: str) -> float | None:
            return replica.stats.registry.get_sample_value("fusionserve_revision_loads_total", {"result": result})

        assert (loads("failed"), loads("loaded")) == (2.0, 1.0)
        assert any("Input/output error" in m for m in said) and any("Stale file handle" in m for m in said), said
    finally:
        runner.done.set()
        follower.join(5)
        log.removeHandler(handler)


def _live_folder(root: Path) -> Path:
    """A live artifact's revisions as `fusionserve tasks` leaves them (no graph: install reads none), serving 1."""
    folder = root / "art"
    (folder / revisions.TASK_FILES).mkdir(parents=True)
    _revision(folder, 1, b"one")
    revisions.publish(folder, 1)
    return folder


def _revision(folder: Path, number: int, data: bytes, file: str | None = None, write: bool = True) -> dict:
    """Revision ``number`` with one task whose file holds ``data``; written into ``folder`` unless not ``write``.
    Returns its bundle (what `fusionserve tasks config` prints as the user_config)."""
    file = file or f"{revisions.TASK_FILES}/t.{number}.npz"
    doc = {"revision": number, "tasks": {"t": {"index": 0, "file": file, "sha256": hashlib.sha256(data).hexdigest()}}}
    name = revisions.revision_path(folder, number).relative_to(folder).as_posix()
    if write:
        (folder / file).write_bytes(data)
        revisions.write(folder, doc)
    blobs = {name: json.dumps(doc).encode(), file: data}
    return {"revision": number, "files": {n: base64.b64encode(b).decode() for n, b in blobs.items()}}


def test_replicas_installing_revisions_at_once_never_move_the_pointer_back(tmp_path, monkeypatch):
    """Two replicas on one node installing revisions from Serve's user_config took no lock: both read CURRENT = 1,
    both published, and the older revision, published last, was served."""
    folder = _live_folder(tmp_path)
    newer, older = _revision(folder, 3, b"three", write=False), _revision(folder, 2, b"two", write=False)
    publish = revisions.publish

    def slow_publish(where: Path, number: int) -> None:
        time.sleep(0.5 if number == 2 else 0.0)  # the replica installing revision 2 is the slower one
        publish(where, number)

    monkeypatch.setattr(revisions, "publish", slow_publish)
    errors: list[BaseException] = []

    def install(bundle: dict) -> None:
        try:
            revisions.install(folder, bundle)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=install, args=(b,)) for b in (older, newer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and revisions.current(folder) == 3


@pytest.mark.parametrize("file", ["../escape.npz", "/tmp/escape.npz", "tasks/../../escape.npz", "model.onnx"])
def test_a_revision_naming_a_file_outside_its_tasks_folder_is_refused(tmp_path, file):
    """The manifest's files were confined to the artifact folder, a revision's were not: install wrote the bundle's
    file where the revision said, and a replica read it from there."""
    folder = _live_folder(tmp_path)
    outside = (folder / file).resolve()
    existed = outside.exists()
    bundle = _revision(folder, 2, b"two", file=file, write=False)
    with pytest.raises(RevisionError, match="tasks/"):
        revisions.install(folder, bundle)
    assert outside.exists() == existed and revisions.current(folder) == 1
    doc = json.loads(base64.b64decode(bundle["files"]["revisions/000002.json"]))
    revisions.revision_path(folder, 2).write_text(json.dumps(doc))
    with pytest.raises(RevisionError, match="tasks/"):
        revisions.read(folder, 2)


def test_a_published_revisions_task_files_are_on_disk_before_the_pointer(built_st, tmp_path, monkeypatch):
    """Task files were renamed into tasks/ without an fsync of the folder before revisions/CURRENT was published (only
    revisions/ was synced): after a power cut CURRENT could name a task file that was not there. Every fsync and
    rename of a live export is recorded in order."""
    from fusionserve.export.artifact import export_artifact

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst, *args, **kwargs) -> None:
        replace(src, dst, *args, **kwargs)
        events.append(("rename", str(Path(dst).resolve())))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    export_artifact(built_st.spec, tmp_path / "art", max_seq_len=16, progress=False, live=True, parity_grid="quick")
    # the export writes into a work folder and renames it into place whole: the revision is published in there
    pointer = next(i for i, (kind, path) in enumerate(events) if kind == "rename" and path.endswith("/revisions/CURRENT"))
    work = events[pointer][1].removesuffix("/revisions/CURRENT")
    task_files = [i for i, (kind, path) in enumerate(events) if kind == "rename" and path.startswith(f"{work}/tasks/")]
    assert task_files and max(task_files) < pointer
    synced = [i for i, event in enumerate(events) if event == ("fsync", f"{work}/tasks")]
    assert any(max(task_files) < i < pointer for i in synced), events
