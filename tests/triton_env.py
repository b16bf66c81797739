"""Triton's own Python client (``tritonclient``) in an environment of its own, for the Open Inference Protocol tests
and the load benchmark's OIP mode.

tritonclient's gRPC client pins ``protobuf < 7`` (2.73: ``protobuf>=6.30,<7``) while fusionserve's committed stubs are
generated for protobuf 7.35 (serving/api/*_pb2.py check it at import), so the two cannot share one environment.
A client never needs the server's package: the tests and the benchmark run tritonclient in ``.venv-triton`` (created
here from PyPI with the pinned version, once per checkout; ``.ci/run`` creates it) and talk to it as a subprocess
(``tests/triton_worker.py``). ``python -m tests.triton_env`` creates it and prints its interpreter: with uv where the
running environment has it (``.ci/run`` installs it into ``.venv``), bytecode compiled as pip does, else with venv and
pip, which is also what a failed uv falls back to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-triton"
REQUIREMENT = "tritonclient[http,grpc]==2.73.0"
WORKER = Path(__file__).resolve().parent / "triton_worker.py"
PYTHON_ENV = "FUSIONSERVE_TEST_TRITON_PYTHON"  # another interpreter with tritonclient (instead of .venv-triton)


def python() -> Path:
    """The interpreter of the tritonclient environment, created first when it is missing (a few seconds from a
    local package cache; about 60 MB). Raises RuntimeError naming the command that failed."""
    chosen = os.environ.get(PYTHON_ENV)
    if chosen:
        return Path(chosen)
    exe = VENV / "bin" / "python"
    check = [str(exe), "-c", "import tritonclient.http, tritonclient.grpc, tritonclient.http.aio, tritonclient.grpc.aio"]
    if exe.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return exe
    failures = []
    for steps in _ways(exe):
        failed = _run(steps)
        if not failed:
            if failures:
                print(f"{VENV.name} made with pip after: {failures[-1]}", file=sys.stderr)
            return exe
        failures.append(failed)
    raise RuntimeError("\n".join(failures))


def _ways(exe: Path) -> list[list[list[str]]]:
    """The ways to create the environment, each a list of commands: uv's first where it is beside this interpreter
    (``sys.executable`` unresolved: the venv's bin/), then venv and pip."""
    pip = [[sys.executable, "-m", "venv", "--clear", str(VENV)], [str(exe), "-m", "pip", "install", "-q", REQUIREMENT]]
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        return [pip]
    install = [str(uv), "pip", "install", "-q", "--compile-bytecode", "--python", str(exe), REQUIREMENT]
    return [[[str(uv), "venv", "-q", "--clear", "--python", sys.executable, str(VENV)], install], pip]


def _run(steps: list[list[str]]) -> str:
    """Runs the commands in turn up to the first that fails; returns what failed ("" when none did)."""
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"{' '.join(step)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
    return ""


if __name__ == "__main__":
    print(python())
