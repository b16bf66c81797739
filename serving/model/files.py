"""Writing a file so that a reader never sees half of it, and (``durable``) so that a power cut leaves either the old
file or the new one: written under a temporary name in the same folder, synced, renamed into place, and the folder
synced (a rename is only on disk once its folder is). The one home of these steps for every file fusionserve
replaces in place: revisions and their pointer, task files, a run folder's owner record."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def temporary(path: Path) -> Path:
    """A name beside ``path`` for writing it, hidden (a leading dot) and this process's own."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], object], durable: bool = True) -> None:
    """Write ``data`` (bytes, or a function writing to a binary file) to ``path`` whole: a reader sees the old file or
    the new one. ``durable``: synced to disk, the folder too, before returning. Raises OSError."""
    tmp = temporary(path)
    try:
        with tmp.open("wb") as fh:
            if isinstance(data, bytes):
                fh.write(data)
            else:
                data(fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        sync_dir(path.parent)


def rename_durable(src: Path, dst: Path) -> None:
    """Rename ``src`` (a file already synced) to ``dst`` and sync ``dst``'s folder: the new name survives a power cut."""
    os.replace(src, dst)
    sync_dir(dst.parent)


def sync_dir(folder: Path) -> None:
    """fsync a folder: the names created, renamed or removed in it are on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
