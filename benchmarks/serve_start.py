"""`fusionserve serve` from launch to serving and from SIGTERM to exit, for one or more installed copies of
fusionserve, round-robin in one run so that the shared machine's load hits each alike (issue 39 item 3: the process
machinery before and after its rewrite).

    python -m benchmarks.serve_start ARTIFACT [--tree NAME=PYTHONPATH ...] [--rounds 3]

A tree is a folder put first on PYTHONPATH (a copy installed with ``pip install --no-deps --target DIR <checkout>``);
``--tree new=`` (empty) is this environment's own fusionserve. Each launch: ``python -m fusionserve.cli.main serve
ARTIFACT --port P``, timed to its "fusionserve: serving" line and to the first 200 on /v1/tasks, then SIGTERM, timed
to its exit (and the exit code). Prints one JSON line per launch and the medians per tree."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/tasks", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def launch(artifact: Path, tree: str, log: Path, timeout_s: float = 300) -> dict[str, float | int | None]:
    """One start and stop of a server from ``tree`` (a PYTHONPATH folder, or "" for this environment)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    port = _free_port()
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(port)]
    started = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    serving_s = answered_s = None
    while time.perf_counter() - started < timeout_s and proc.poll() is None:
        if serving_s is None and "fusionserve: serving" in log.read_text():
            serving_s = time.perf_counter() - started
        if serving_s is not None and _answers(port):
            answered_s = time.perf_counter() - started
            break
        time.sleep(0.05)
    stopped = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = None
    return {"serving_s": serving_s, "answered_s": answered_s, "stop_s": time.perf_counter() - stopped, "exit": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PYTHONPATH")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": ""}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(args.rounds):
            for name, tree in trees.items():
                out = launch(args.artifact, tree, Path(logs) / f"{name}-{r}.log")
                runs[name].append(out)
                print(
                    json.dumps(
                        {"tree": name, "round": r, **{k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}}
                    ),
                    flush=True,
                )
    for name, rows in runs.items():
        medians = {k: statistics.median(x[k] for x in rows if x[k] is not None) for k in ("serving_s", "answered_s", "stop_s")}
        exits = [x["exit"] for x in rows]
        print(f"{name}: median launch->serving {medians['serving_s']:.1f} s, ->first 200 {medians['answered_s']:.1f} s, "
              f"SIGTERM->exit {medians['stop_s']:.1f} s; exit codes {exits}")  # fmt: skip


if __name__ == "__main__":
    main()
