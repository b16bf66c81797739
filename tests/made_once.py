"""Session fixtures whose result is a folder on disk (an exported artifact, a stats file), made once per test run and
read by every pytest-xdist worker of it: a session fixture is otherwise made once per worker, and CI runs three.

``made_once(tmp_path_factory, key, make)`` takes a lock on ``key`` in a folder the run's workers share (under xdist
the parent of the workers' basetemps, without it the basetemp: pytest makes either afresh for each run, so nothing
carries over from one run to the next); the first worker to ask calls ``make`` on an empty folder of a temporary name
and renames it into place, the others wait for the lock and read what it made. ``key`` names everything the folder's
content depends on: the fixture, its parameters and, for what is made from a model, ``source_digest`` of the model's
files. Each worker still builds its own model (the in-memory reference of the parity tests; builds are cheap, an
export is not), so a worker reuses an export only when its own build has the same bytes as the build the export was
made from; otherwise the digests differ and it makes its own. The manifest's ``sources.spec.path`` (and a stats file's
``model.path``) then names the build of the worker that made the folder, a different folder of the same files.

``make`` must not ask for another ``made_once`` folder: a worker holding one key's lock while it waits for a second
one could wait forever for a worker that does the reverse. Fixtures ask for what they need before their body runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder shared by the workers of this run (``popen-gwN``'s parent under xdist), fresh for each run."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "made-once"


def source_digest(spec: Path) -> str:
    """A digest of the model's files as an export reads them (the files its manifest's ``sources`` lists), but not of
    where they lie: AdapterHub writes the base model's path into every adapter's and head's config ("model_name"), so
    the build's own folder is left out of each file's bytes. Two builds of the same model in two workers' folders have
    one digest; a build that differs in any other byte has another."""
    from fusionserve.export.artifact import _source_checksums
    from fusionserve.export.spec import load_spec

    loaded = load_spec(spec)
    root = loaded.path.parent
    digest = hashlib.sha256(loaded.path.read_bytes())
    for name in sorted(_source_checksums(loaded)["files"]):
        data = (root / name).read_bytes()
        for where in {str(root), str(root.resolve())}:
            data = data.replace(where.encode(), b"<build>")
        digest.update(f"\0{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def made_once(tmp_path_factory: pytest.TempPathFactory, key: str, make: Callable[[Path], None]) -> Path:
    """The folder ``key`` of this run: made by ``make(folder)`` in the first worker that asks, read by the others."""
    root = run_root(tmp_path_factory)
    root.mkdir(exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
    out = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, and by the kernel if the worker dies
        if not out.is_dir():
            work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
            try:
                make(work)
                work.rename(out)  # atomic: a folder is there whole or not at all
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return out


def export_once(tmp_path_factory: pytest.TempPathFactory, name: str, spec: Path, **options: Any) -> Path:
    """``export_artifact(spec, FOLDER, **options)`` once per test run, read by every worker whose build of ``spec`` has
    the same files: FOLDER. Only for artifacts the tests read: a live one (``tasks add``) is written to."""
    from fusionserve.export.artifact import export_artifact

    assert not options.get("live"), "a live artifact is written to: each test module exports its own"
    key = "-".join([name, source_digest(spec), *(f"{k}={v}" for k, v in sorted(options.items()))])
    make = lambda folder: export_artifact(spec, folder / "artifact", progress=False, **options)  # noqa: E731
    return made_once(tmp_path_factory, key, make) / "artifact"
