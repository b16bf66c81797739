"""Every start-up refusal of `fusionserve serve` (a bad artifact, a bad option, a taken port) is one
``fusionserve: error: ...`` line and exit 2, with no traceback and before Ray starts, whichever way the server
process starts: with the loopback shim preloaded, or without it (no shim: the server then warns once and goes on)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving_helpers import free_port

pytestmark = pytest.mark.slow

# the two ways the server process starts: the shim preloaded (the package's, or built), or none (a named shim that is
# not there: the server warns once and serves without it)
PATHS = {"preloaded": {}, "no shim": {"FUSIONSERVE_LOOPBACK_SHIM": "/nonexistent/loopback_bind.so"}}


def _serve(artifact: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(free_port()), *args]
    full = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **env)
    full.pop("RAY_ADDRESS", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full, check=False)


def _refused(done: subprocess.CompletedProcess) -> str:
    """The one error line of a refusal; fails the test on anything else (a traceback, more lines, another exit)."""
    lines = [line for line in done.stderr.splitlines() if "WARNING: " not in line]  # the no-shim warning, said once
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("fusionserve: error: "), done.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("path", PATHS)
def test_a_taken_port_is_one_line(artifact, path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = _refused(_serve(artifact, "--port", str(port), env=PATHS[path]))
    assert f"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}" in line


@pytest.mark.parametrize("path", PATHS)
def test_a_bad_artifact_is_one_line(tmp_path, path):
    (tmp_path / "manifest.json").write_text("{not json")
    line = _refused(_serve(tmp_path, env=PATHS[path]))
    assert "manifest.json" in line


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--max-batch-size", "0"), "--max-batch-size = 0 is out of range"),
        (("--default-task", "nope"), "default_task 'nope' is not a task of"),
        (("--max-batch-tokens", "4"), "max_batch_tokens"),
    ],
    ids=["range", "default-task", "batch-tokens"],
)
def test_a_bad_option_is_one_line_before_ray_starts(artifact, path, args, said):
    line = _refused(done := _serve(artifact, *args, env=PATHS[path]))
    assert said in line and "starting Ray" not in done.stderr, done.stderr
