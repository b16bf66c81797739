"""`fusionserve serve` from launch to serving and from SIGTERM to exit, for one or more installed copies of
fusionserve, round-robin in one run so that the shared machine's load hits each alike (issue 39 item 3: the process
machinery before and after its rewrite).

    python -m benchmarks.serve_start ARTIFACT [--tree NAME=PYTHONPATH ...] [--variant NAME=VAR=VALUE,... ...]
                                     [--rounds 3] [--idle-s 5] [--signal TERM]

A tree is a folder put first on PYTHONPATH (a copy installed with ``pip install --no-deps --target DIR <checkout>``);
``--tree new=`` (empty) is this environment's own fusionserve. Each launch: ``python -m fusionserve.cli.main serve
ARTIFACT --port P``, timed to its "fusionserve: serving" line and to the first 200 on /v1/tasks, then SIGTERM, timed
to its exit (and the exit code). A variant is an environment of its own (``--variant noprestart=RAY_X=0,RAY_Y=0``;
``--variant base=`` the environment as it is), crossed with the trees. ``--idle-s``: seconds the server idles after
its first 200 before the signal (``--signal INT`` is a Ctrl-C).

CPU: ``by_part`` is each process's own CPU seconds as last seen by a sampler of the launch's tree (psutil, every
0.2 s; a process's last 0.2 s before it ends are missed, so the figures are a little low), summed by the process's
name (``ray::ServeController``, ``gcs_server``, ...); ``cpu_s`` is their sum, the whole launch. (This process's
children's resource usage is no measure: Ray's workers outlive the raylet that would collect them, and their CPU time
is never counted there.) Prints one JSON line per launch and the medians per tree and
variant."""

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
from typing import Any


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


def _part(proc: Any) -> str:
    """A process's part: Ray's title (``ray::ServeController``), else its program's name and, for Python, its module or
    script (``python ray/dashboard/dashboard.py``)."""
    argv = proc.cmdline()
    if not argv:
        return proc.name()
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    name = Path(argv[0]).name
    if name.startswith("python") and len(argv) > 1:
        script = next((a for a in argv[1:] if a.endswith(".py")), None)
        if script:
            return f"python {'/'.join(Path(script).parts[-2:])}"
        if "-m" in argv:
            return f"python -m {argv[argv.index('-m') + 1]}"
        if "-c" in argv:
            return "python -c (the server)"
    return name


class _Sampler:
    """The CPU seconds of every process below ``pid``, as last seen (see the module's notes)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root, self.seen = psutil.Process(pid), {}

    def sample(self) -> None:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
                key = (proc.pid, proc.create_time())
                self.seen[key] = (_part(proc), times.user + times.system)
            except psutil.Error:
                continue

    def by_part(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for part, cpu in self.seen.values():
            out[part] = out.get(part, 0.0) + cpu
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def launch(
    artifact: Path,
    tree: str,
    log: Path,
    timeout_s: float = 300,
    extra_env: dict[str, str] | None = None,
    idle_s: float = 0.0,
    sig: signal.Signals = signal.SIGTERM,
) -> dict:
    """One start and stop of a server from ``tree`` (a PYTHONPATH folder, or "" for this environment), with
    ``extra_env`` in its environment, idling ``idle_s`` after its first 200 before ``sig``."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **(extra_env or {}))
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    port = _free_port()
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(port)]
    started = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sampler = _Sampler(proc.pid)
    serving_s = answered_s = None
    while time.perf_counter() - started < timeout_s and proc.poll() is None:
        sampler.sample()
        if serving_s is None and "fusionserve: serving" in log.read_text():
            serving_s = time.perf_counter() - started
        if serving_s is not None and _answers(port):
            answered_s = time.perf_counter() - started
            break
        time.sleep(0.2)
    while answered_s is not None and time.perf_counter() - started < answered_s + idle_s:
        sampler.sample()
        time.sleep(0.2)
    stopped = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(sig)
    code: int | None = None
    while time.perf_counter() - stopped < 120 and code is None:
        sampler.sample()
        try:
            code = proc.wait(0.2)
        except subprocess.TimeoutExpired:
            continue
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {
        "serving_s": serving_s,
        "answered_s": answered_s,
        "stop_s": time.perf_counter() - stopped,
        "exit": code,
        "cpu_s": sum(sampler.by_part().values()),
        "by_part": {k: round(v, 2) for k, v in sampler.by_part().items()},
    }


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--variant`` values (``NAME=VAR=VALUE,...``) as name -> the environment variables it sets; none given: one
    variant, ``base``, the environment as it is."""
    variants = {}
    for v in specs or ["base="]:
        name, _, pairs = v.partition("=")
        variants[name] = dict(p.split("=", 1) for p in pairs.split(",") if p)
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PYTHONPATH")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VAR=VALUE,...")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=0.0)
    parser.add_argument("--signal", default="TERM", choices=["TERM", "INT"])
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": ""}
    variants = parse_variants(args.variant)
    sig = signal.Signals[f"SIG{args.signal}"]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(args.rounds):
            for tname, tree in trees.items():
                for vname, extra in variants.items():
                    name = f"{tname}/{vname}"
                    out = launch(args.artifact, tree, Path(logs) / f"{tname}-{vname}-{r}.log", 300, extra, args.idle_s, sig)
                    runs.setdefault(name, []).append(out)
                    row = {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}
                    print(json.dumps({"run": name, "round": r, **row}), flush=True)
    for name, rows in runs.items():
        keys = ("serving_s", "answered_s", "stop_s", "cpu_s")
        medians = {k: statistics.median([x[k] for x in rows if x[k] is not None] or [float("nan")]) for k in keys}
        exits = [x["exit"] for x in rows]
        print(f"{name}: median launch->serving {medians['serving_s']:.1f} s, ->first 200 {medians['answered_s']:.1f} s, "
              f"SIG{args.signal}->exit {medians['stop_s']:.1f} s, CPU {medians['cpu_s']:.1f} s; exit codes {exits}")  # fmt: skip


if __name__ == "__main__":
    main()
