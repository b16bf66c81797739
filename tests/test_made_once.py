"""tests/made_once.py: a folder made once per test run for every xdist worker of it, and the key that says whether two
workers' builds may share an export."""

import multiprocessing
import time
from pathlib import Path

import pytest

from tests.adapterhub_models import build
from tests.made_once import made_once, run_root, source_digest


class Factory:
    """What made_once reads of pytest's tmp_path_factory: a worker's basetemp."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _ask(base: str, log: str, out: multiprocessing.Queue) -> None:
    def make(folder: Path) -> None:
        with open(log, "a") as fh:
            fh.write("made\n")
        time.sleep(0.3)  # the others ask meanwhile
        (folder / "result").write_text("whole")

    folder = made_once(Factory(Path(base)), "k/1", make)
    out.put((str(folder), (folder / "result").read_text()))


def test_three_workers_asking_at_once_get_one_folder_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # the workers' basetemps are popen-gwN under the run's folder
    ctx = multiprocessing.get_context("fork")
    out, log = ctx.Queue(), tmp_path / "log"
    workers = [ctx.Process(target=_ask, args=(str(tmp_path / f"popen-gw{i}"), str(log), out)) for i in range(3)]
    for w in workers:
        w.start()
    got = [out.get(timeout=30) for _ in workers]
    for w in workers:
        w.join(timeout=30)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    assert log.read_text() == "made\n"
    assert got == [(str(tmp_path / "made-once" / "k_1"), "whole")] * 3
    assert sorted(p.name for p in (tmp_path / "made-once").iterdir()) == [".k_1.lock", "k_1"]  # no half-made folder


def test_a_make_that_fails_leaves_nothing_and_the_next_asker_makes_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # without xdist: the basetemp itself
    factory = Factory(tmp_path)
    assert run_root(factory) == tmp_path / "made-once"

    def fail(folder: Path) -> None:
        (folder / "half").write_text("")
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        made_once(factory, "k", fail)
    assert [p.name for p in (tmp_path / "made-once").iterdir()] == [".k.lock"]
    folder = made_once(factory, "k", lambda f: (f / "result").write_text("second"))
    assert (folder / "result").read_text() == "second"
    assert made_once(factory, "k", lambda f: pytest.fail("made twice")) == folder


def test_two_builds_in_two_folders_share_a_digest_and_a_changed_weight_does_not(tmp_path):
    first, second = build(tmp_path / "a", safetensors=True), build(tmp_path / "b", safetensors=True)
    config = "adapters/alpha/adapter_config.json"
    assert str(tmp_path / "a") in (tmp_path / "a" / config).read_text()  # AdapterHub writes the base model's path
    assert source_digest(first.spec) == source_digest(second.spec)
    weights = next((tmp_path / "b" / "adapters" / "alpha").glob("adapter.*"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert source_digest(first.spec) != source_digest(second.spec)
