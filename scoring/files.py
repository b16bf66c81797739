"""The one place where the offline commands (predict, score, evaluate, calibrate) open a file they write: an output
is never one of the job's inputs — the same path, a symlink to it, or a hard link to it — so no command can empty
its own input. Every refusal is an InputError of one line naming the file (the CLI prints it and exits 2).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from fusionserve.errors import InputError


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names, symlinks followed; None when there is nothing there."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def model_files(model: str | Path) -> list[Path]:
    """The files a model argument reads that an output could land on: a spec file, or an artifact's files."""
    path = Path(model)
    if path.is_dir():
        return [p for p in path.iterdir() if p.is_file()]
    return [path]


def check_output(path: Path, inputs: Iterable[Path] = (), what: str = "--output") -> None:
    """Refuse an output that would change an input or cannot be written, before any work is done: ``path`` is one
    of ``inputs`` (itself, a symlink or a hard link to it), a folder, in a folder that does not exist, or in a place
    where no file can be created. Nothing is truncated: the probe opens for appending, and removes what it made.
    ``what`` names the path in the message (an option, or "the side file of --output"). Raises InputError."""
    here, where = _identity(path), path.resolve()
    for src in inputs:
        if (here is not None and _identity(src) == here) or src.resolve() == where:
            raise InputError(f"{what} {path} is the input file {src}; write to another file")
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder; name a file to write")
    parent = path.parent
    if not parent.exists():
        raise InputError(f"{what} {path}: its folder {parent} does not exist")
    if not parent.is_dir():
        raise InputError(f"{what} {path}: {parent} is not a folder")
    existed = path.exists()
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666))
    except OSError as exc:
        raise InputError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def open_output(path: Path, mode: str = "w", inputs: Iterable[Path] = (), what: str = "--output") -> IO[Any]:
    """``path`` opened for writing in ``mode`` ("w", "wb", "ab", "r+b", ...), after ``check_output``. Text modes are
    UTF-8. Raises InputError for a refused path or one the system will not open."""
    check_output(path, inputs, what)
    try:
        if "b" in mode:
            return path.open(mode)
        return path.open(mode, encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
