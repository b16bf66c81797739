"""The one place where the offline commands (predict, score, evaluate, calibrate) open their files.

Outputs: an output is never one of the job's inputs — the same path, a symlink to it, or a hard link to it — so no
command can empty its own input. Inputs: a folder, a missing or unreadable file, or UTF-16/32 text is refused as a
whole; lines are read in bounded memory, and a row over ``max_row_bytes`` (``MAX_ROW_BYTES`` unless the command's
``--max-row-bytes`` says otherwise) is read through and reported as that row's error while the job goes on. Every
refusal is an InputError of one line naming the file (the CLI prints it and exits 2).
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

from fusionserve.errors import InputError

# A row's bytes (a JSONL line, a CSV row, a Parquet record's text and bytes values): 1 MiB, some 400 times what the
# longest token limit (512) holds, while a 50 MB row costs seconds and gigabytes to tokenize.
MAX_ROW_BYTES = 1 << 20
READ_BYTES = 1 << 16  # how much of an over-long line is read at a time while skipping it
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))
_UTF8_BOM = b"\xef\xbb\xbf"


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
    except OSError as exc:  # ENOENT with the folder there: a file system that makes no files (/proc)
        why = f"no file can be created in {parent}" if exc.errno == errno.ENOENT else exc.strerror or exc
        raise InputError(f"cannot write {what} {path}: {why}") from None
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


def open_input(path: Path, text: bool = True) -> BinaryIO:
    """``path`` opened for reading, in binary. ``text``: the file must be UTF-8 (JSONL, CSV), so UTF-16 or UTF-32 (a
    byte-order mark or NUL bytes at the start) is refused here rather than as every row's error. Raises InputError
    for a missing file, a folder, an unreadable file, or such text."""
    if path.is_dir():
        raise InputError(f"input file {path} is a folder; name a file")
    if not path.exists():
        raise InputError(f"input file not found: {path}")
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise InputError(f"cannot read input file {path}: {exc.strerror or exc}") from None
    if text:
        try:
            start = fh.read(64)
            fh.seek(0)
        except OSError as exc:
            fh.close()
            raise InputError(f"cannot read input file {path}: {exc.strerror or exc}") from None
        kind = next((name for bom, name in _BOMS if start.startswith(bom)), "UTF-16 or UTF-32" if b"\0" in start else None)
        if kind is not None:
            fh.close()
            raise InputError(
                f"input file {path} looks {kind}-encoded; fusionserve reads UTF-8: convert it "
                f"(e.g. iconv -f {kind.split()[0]} -t UTF-8 {path.name} > {path.stem}.utf8{path.suffix})"
            )
    return fh


def lines(fh: BinaryIO, max_row_bytes: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number from 1, line, its size in bytes) for every line of ``fh``, a UTF-8 byte-order mark dropped; the
    line is None when it is over ``max_row_bytes``: it is read through ``READ_BYTES`` at a time, never held whole."""
    for no in itertools.count(1):
        line = fh.readline(max_row_bytes + 1)
        if not line:
            return
        if no == 1 and line.startswith(_UTF8_BOM):
            line = line[len(_UTF8_BOM) :]
        if len(line) <= max_row_bytes or line.endswith(b"\n"):
            yield no, line, len(line)
            continue
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = fh.readline(READ_BYTES)
            size += len(line)
        yield no, None, size


def too_long(size: int, max_row_bytes: int) -> InputError:
    """The error of a row over the limit, with both numbers and the option that sets it."""
    return InputError(f"row is {size:,} bytes, over the limit of {max_row_bytes:,} (--max-row-bytes); left out")


def not_utf8(data: bytes, exc: UnicodeDecodeError) -> InputError:
    """The error of a row that is not UTF-8: the first bad byte and its column, and what to do."""
    return InputError(
        f"not valid UTF-8: byte 0x{data[exc.start]:02x} at column {exc.start + 1}; convert the file to UTF-8 "
        "(a latin-1 file: iconv -f LATIN1 -t UTF-8)"
    )
