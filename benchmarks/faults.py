"""Faults under load (issue 27): one server (2 replicas, the tiny test model), 16 clients, and one kill at a time: a
replica, HAProxy, the server process (kill -9, then a restart on the same port, as a supervisor makes it), Ray's
raylet (the server ends with exit 1; then the same restart). Also the stop and start figures an operator's
supervisor needs: group SIGTERM to exit, and to nothing left.

    python -m benchmarks.faults [--out benchmarks/results/faults.json]

What counts as lost, retried or hung: tests/fault_helpers.py (the same clients tests/test_serving_faults_load.py
uses to assert the behaviour). Figures into benchmarks/RESULTS.md by hand, with the machine and its load."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from fusionserve.export.artifact import export_artifact
from fusionserve.serving.process.ports import port_holder
from tests.adapterhub_models import build
from tests.fault_helpers import CLIENTS, kill_haproxy, kill_raylet, kill_replica, processes, under_load
from tests.serving_helpers import MARK_ENV, alive, carrying, free_port, launch, new_mark


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/faults.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fs-bench-faults-"))
    art = work / "art"
    export_artifact(build(work / "model", safetensors=True, seed=3).spec, art, max_seq_len=32, progress=False)
    mark = new_mark()
    env = dict(os.environ, **{MARK_ENV: mark})
    port = free_port()
    rows: list[dict] = []
    started: list[float] = []

    def start(name: str):
        t = time.monotonic()
        served = launch(art, work / f"{name}.log", "--replicas", "2", "--threads", "1", port=port, env=env, own_group=True)
        started.append(round(time.monotonic() - t, 1))
        return served

    def run(fault: str, kill, restart=None) -> None:
        before = processes(state["served"].proc.pid)
        row = under_load(port, fault, kill, restart, bound_s=180)
        time.sleep(10)
        row["left_after_10_s"] = [c[:60] for p, c in before.items() if alive({p}) and p in killed_tree(before, fault)]
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)

    def killed_tree(before: dict[int, str], fault: str) -> set[int]:
        # after a replica or HAProxy kill the server goes on: only the killed process counts; after the server or
        # the raylet, its whole tree
        return set(before) if fault in ("server (kill -9)", "raylet") else set(state["killed"])

    state: dict = {"served": start("first"), "killed": []}
    try:
        pid = state["served"].proc.pid
        run("replica", lambda: state.update(killed=kill_replica(pid)))
        run("HAProxy", lambda: state.update(killed=kill_haproxy(pid)))

        def kill_server() -> None:
            os.kill(state["served"].proc.pid, signal.SIGKILL)
            state["served"].proc.wait()

        def restart() -> None:
            while port_holder("127.0.0.1", port):
                time.sleep(0.1)
            state["served"] = start("restarted")

        run("server (kill -9)", kill_server, restart)
        run("raylet", lambda: kill_raylet(state["served"].proc.pid), lambda: (state["served"].proc.wait(), restart()))
        tree = set(processes(state["served"].proc.pid)) | {state["served"].proc.pid}
        sent = time.monotonic()
        os.killpg(state["served"].proc.pid, signal.SIGTERM)
        code = state["served"].proc.wait(60)
        exited = time.monotonic() - sent
        while alive(tree) and time.monotonic() - sent < 60:
            time.sleep(0.1)
        stop = {"group_sigterm_exit_code": code, "exit_s": round(exited, 1), "nothing_left_s": round(time.monotonic() - sent, 1)}
    finally:
        for pid in carrying(mark):
            os.kill(pid, signal.SIGKILL)
    out = {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "clients": CLIENTS,
        "start_s": started,
        "stop": stop,
        "faults": rows,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("| fault | requests | answered 200 | lost | answered 4xx | hung | outage (s) | back after (s) | left after 10 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['fault']} | {r['requests']} | {r['ok']} | {r['lost']} | {r['answered_4xx']} | {r['hung']} | "
            f"{r['outage_s']} | {r['back_after_s']} | {len(r['left_after_10_s'])} |"
        )
    print(f"start: {started} s; group SIGTERM: {stop}; {out['cpu']}, load average {out['load_average']}")


if __name__ == "__main__":
    main()
