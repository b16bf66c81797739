"""A missing extra, a Ray cluster that cannot be reached or a local Ray that does not start ends ``fusionserve`` with
one readable line naming what to do (exit 2), never a traceback. Each missing extra runs the real CLI in a fresh
interpreter where the package is made unimportable; the Ray cases run it in-process, without ever starting Ray."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from fusionserve.cli.main import main
from tests.import_helpers import cli_without
from tests.serving_helpers import free_port


def _one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def artifact_and_input(tmp_path_factory, artifact) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("extras")
    rows = folder / "in.jsonl"
    rows.write_text(json.dumps({"text": "a fine film"}) + "\n", encoding="utf-8")
    return artifact, rows


@pytest.mark.slow
def test_score_without_pyarrow_names_the_batch_extra(artifact_and_input, tmp_path):
    art, rows = artifact_and_input
    done = cli_without(
        ["pyarrow"], ["score", str(art), "--task", "rte", "--input", str(rows), "--output", str(tmp_path / "o.jsonl")]
    )
    assert _one_line(done) == (
        "fusionserve: error: 'fusionserve score' needs pyarrow, which is not installed: pip install 'fusionserve[batch]'"
    )


@pytest.mark.slow
def test_serve_without_ray_names_the_serve_extra(artifact_and_input):
    art, _ = artifact_and_input
    done = cli_without(["ray"], ["serve", str(art), "--port", "8099"])
    assert (
        _one_line(done)
        == "fusionserve: error: 'fusionserve serve' needs ray, which is not installed: pip install 'fusionserve[serve]'"
    )


@pytest.mark.slow
def test_export_without_torch_names_the_export_extra(built_st, tmp_path):
    done = cli_without(["torch"], ["export", str(built_st.spec), "--out", str(tmp_path / "art")])
    assert _one_line(done) == (
        "fusionserve: error: 'fusionserve export' needs torch, which is not installed: pip install 'fusionserve[export]'"
    )


def test_a_broken_fusionserve_import_is_not_mistaken_for_a_missing_extra(monkeypatch):
    import fusionserve.cli.model_commands as commands

    def broken(args):
        raise ModuleNotFoundError("No module named 'fusionserve.nothing'", name="fusionserve.nothing")

    monkeypatch.setattr(commands, "run_inspect", broken)
    with pytest.raises(ModuleNotFoundError):
        main(["inspect", "x"])


def test_serve_against_a_ray_address_where_nothing_answers_fails_at_once(artifact_and_input, monkeypatch, capsys):
    art, _ = artifact_and_input
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert main(["serve", str(art), "--port", "8099"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"fusionserve: starting Ray (joining 127.0.0.1:{port})", lines[-1]]  # a step line, then one error line
    assert lines[-1].startswith(f"fusionserve: error: could not join the Ray cluster at 127.0.0.1:{port}: nothing answers there")


@pytest.fixture
def environ_kept():
    """``serve`` puts the ingress settings in os.environ for Ray's processes to read: give the test process its own back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_serve_when_a_local_ray_cannot_start_fails_in_one_line(artifact_and_input, monkeypatch, capsys, environ_kept):
    import ray

    def cannot_start(*args, **kwargs):  # unit tests never start Ray: its start-up failure, as Ray raises one
        raise RuntimeError("Failed to start the GCS server.\nSee the logs in /tmp/ray/session_latest/logs")

    art, _ = artifact_and_input
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever another test left, this one starts Ray
    monkeypatch.setattr(ray, "init", cannot_start)
    assert main(["serve", str(art), "--port", str(free_port())]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "fusionserve: starting Ray (a local instance)",  # the step line, then one error line
        "fusionserve: error: could not start a local Ray instance: RuntimeError: Failed to start the GCS server.",
    ]
