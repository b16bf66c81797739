"""What one `fusionserve score --ray` run costs when it starts its own local Ray, in CPU seconds by process and wall
seconds, per environment variant, round-robin in one run (the same sampler as benchmarks/serve_start.py).

    python -m benchmarks.score_start ARTIFACT INPUT --task TASK [--variant NAME=VAR=VALUE,... ...] [--rounds 3]

Each run: ``python -m fusionserve.cli.main score ARTIFACT --task TASK --input INPUT --output TMP --ray --overwrite``
until it exits. Prints one JSON line per run and the medians per variant."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.serve_start import _Sampler, parse_variants


def run(artifact: Path, data: Path, task: str, out: Path, extra: dict[str, str]) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **extra)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "score", str(artifact), "--task", task, "--input", str(data)]
    cmd += ["--output", str(out), "--ray", "--overwrite"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    sampler = _Sampler(proc.pid)
    while proc.poll() is None:
        sampler.sample()
        time.sleep(0.2)
    parts = sampler.by_part()
    return {"wall_s": time.perf_counter() - started, "exit": proc.returncode, "cpu_s": sum(parts.values()),
            "by_part": {k: round(v, 2) for k, v in parts.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("input", type=Path)
    parser.add_argument("--task", required=True)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VAR=VALUE,...")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = parse_variants(args.variant)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, extra in variants.items():
                out = run(args.artifact, args.input, args.task, Path(tmp) / f"{name}-{r}{args.input.suffix}", extra)
                runs.setdefault(name, []).append(out)
                row = {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}
                print(json.dumps({"run": name, "round": r, **row}), flush=True)
    for name, rows in runs.items():
        wall, cpu = (statistics.median(x[k] for x in rows) for k in ("wall_s", "cpu_s"))
        print(f"{name}: median wall {wall:.1f} s, CPU {cpu:.1f} s; exit codes {[x['exit'] for x in rows]}")


if __name__ == "__main__":
    main()
