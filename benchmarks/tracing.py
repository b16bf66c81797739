"""What tracing costs, and whether a trace accounts for a request's time: three servers of one artifact side by side
(each its own `fusionserve serve`), measured in turn, round by round (the order rotating), on one shared machine:

- ``today``: the code of a git ref (``--baseline-ref``, default main) run from a copy of its tree: no tracing code;
- ``off``: this tree, no OTLP endpoint (the tracer does not exist);
- ``on``: this tree, ``--otlp-endpoint`` to a real OTLP/HTTP receiver in this process (tests/oip_helpers.py, which
  decodes every export request), every request sampled.

Each run: ``--clients`` closed-loop clients on POST /v1/classify for ``--seconds``. Then ``--spans`` requests, one at a
time, each with its own ``traceparent``, against ``on``: the client's measured latency beside the request's root span
and the sum of its stage spans (ingress, parse, tokenize, queue, batch, respond) as the receiver got them
(benchmarks/trace_spans.py, which also measures them at 16 clients).

    python -m benchmarks.tracing [ARTIFACT] [--baseline-ref main] [--clients 16] [--seconds 10] [--rounds 4] [--spans 100]

Writes benchmarks/results/tracing.json, tracing.png and the section in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.httpload import closed_loop
from benchmarks.load import load_texts
from benchmarks.report import machine, record
from benchmarks.servers import ROOT, artifact_and_task, body_maker, tree_cpu_s
from benchmarks.trace_spans import measure
from fusionserve.serving.process.ingress import free_port

HERE = Path(__file__).parent
_PACKAGES = ("cli", "export", "serving", "scoring", "training")  # the subpackages pyproject maps under fusionserve


def baseline_tree(ref: str) -> Path:
    """The files of git ``ref`` in a temporary folder, importable as ``fusionserve`` from there (its subpackages linked
    where pyproject's package-dir puts them), so a server started with it as working directory and PYTHONPATH runs
    that code, this checkout's installed dependencies under it."""
    tree = Path(tempfile.mkdtemp(prefix="fusionserve-baseline-"))
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    for name in _PACKAGES:
        (tree / "fusionserve" / name).symlink_to(tree / name)
    return tree


def start(name: str, artifact: Path, logs: Path, extra: list[str], tree: Path | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", OTEL_BSP_SCHEDULE_DELAY="200")
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_EXPORTER")}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    log = logs / f"{name}.log"
    cmd = [sys.executable, "-m", "fusionserve.cli.main", "serve", str(artifact), "--port", str(port), *extra]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tree or ROOT)
    until = time.monotonic() + 300
    while "fusionserve: serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > until:
            proc.kill()
            raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, port


def receiver_cpu_s() -> float:
    """CPU seconds of this process's threads but the main one (where the clients run): the OTLP receiver's."""
    import psutil

    main = threading.main_thread().native_id
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id != main)


def markdown(r: dict[str, Any]) -> str:
    m, s = r["machine"], r["spans"]
    med = {k: v["throughput_rps_median"] for k, v in r["servers"].items()}
    on_off, off_today = med["on"] / med["off"], med["off"] / med["today"]
    cpu = {k: v["server_cpu_ms_per_request"] for k, v in r["servers"].items()}
    lines = [
        f"Command: `{r['command']}`",
        "",
        f"Machine: {m['cpu']} ({m['isa']}), {m['cores']} cores shared by the three servers, the clients and the receiver; "
        f"load average {m['load_average']} at the start, {r['load_average_end']} at the end; {m['date']}. Task `{r['task']}` "
        f"of `{r['artifact']}`; {r['clients']} closed-loop clients on POST /v1/classify, {r['seconds']:g} s a run, "
        f"{r['rounds']} rounds, the order rotating.",
        "",
        "| server | req/s per round | median req/s | median p50 (ms) | median p99 (ms) | server CPU ms a request |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, v in r["servers"].items():
        lines.append(f"| {name} | {', '.join(str(x) for x in v['throughput_rps'])} | {v['throughput_rps_median']} | "
                     f"{v['p50_ms_median']} | {v['p99_ms_median']} | {v['server_cpu_ms_per_request']} |")  # fmt: skip
    lines += [
        "",
        f"- Tracing on (every request sampled, a real OTLP receiver) / off: {on_off:.3f} "
        f"(target >= 0.97: {'met' if on_off >= 0.97 else 'NOT met'}). The server's CPU a request (all its processes, "
        f"summed over the rounds: what a load on the machine distorts least), off / on: {cpu['off'] / cpu['on']:.3f}.",
        f"- The receiver's own CPU (it decodes every span in Python, in the benchmark's process, on the same cores): "
        f"{r['servers']['on']['receiver_cpu_us_per_request']} µs a request of `on`, charged against `on` as a "
        "collector on the same machine would be.",
        f"- Tracing off / today's code ({r['baseline_ref']}): {off_today:.3f} (no measurable change: "
        f"{'none measured' if abs(off_today - 1) <= 0.03 else 'a change of ' + format(off_today - 1, '+.1%')}, rounds' spread above).",
        f"- One request's spans against its latency measured by the client ({s['traces_received']} of {s['requests']} "
        f"traces received; median client latency {s['client_ms_median']} ms): stages / client latency median "
        f"{s['stages_over_client_median']}, lowest {s['stages_over_client_min']}; within 10%: {s['within_10pct_share']:.0%} "
        f"of requests (target: within 10%); root span / client latency median {s['root_over_client_median']}.",
    ]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(r["servers"])
    ax.bar(names, [r["servers"][n]["throughput_rps_median"] for n in names])
    ax.set_ylabel(f"req/s, {r['clients']} clients (median of rounds)")
    ax.set_title("Tracing: today / off / on (every request sampled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from tests.oip_helpers import start_receiver

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", help="artifact folder (default: the built-in model)")
    p.add_argument("--baseline-ref", default="main", help="git ref whose code is 'today' (default main)")
    p.add_argument("--task", help="task to load (default: the first fusion task)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--spans", type=int, default=100, help="requests whose spans are compared with their latency")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.artifact, task, _ = artifact_and_task(args.artifact, args.task)
    texts = load_texts("rotten_tomatoes")
    receiver, logs = start_receiver(), Path(tempfile.mkdtemp(prefix="fusionserve-tracing-"))
    result: dict[str, Any] = {"command": "python -m benchmarks.tracing " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "machine": machine(), "task": task, "artifact": str(args.artifact), "clients": args.clients,
                              "seconds": args.seconds, "rounds": args.rounds, "baseline_ref": args.baseline_ref}  # fmt: skip
    plan = {"today": ([], baseline_tree(args.baseline_ref)), "off": ([], None),
            "on": (["--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "1"], None)}  # fmt: skip
    procs = {}
    try:
        for name, (extra, tree) in plan.items():
            procs[name] = start(name, args.artifact, logs, extra, tree)
            print(f"tracing: {name} up on port {procs[name][1]}", file=sys.stderr)
        body = body_maker(task, texts)
        for _, port in procs.values():
            closed_loop(port, "/v1/classify", body, args.clients, 3.0)  # warm-up
        runs: dict[str, list[dict]] = {n: [] for n in plan}
        names = list(plan)
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                before, server_before = receiver_cpu_s(), tree_cpu_s(procs[name][0].pid)
                runs[name].append(closed_loop(procs[name][1], "/v1/classify", body, args.clients, args.seconds))
                runs[name][-1]["receiver_cpu_s"] = receiver_cpu_s() - before
                runs[name][-1]["server_cpu_s"] = tree_cpu_s(procs[name][0].pid) - server_before
                print(f"  round {r + 1}, {name}: {runs[name][-1]['throughput_rps']} req/s", file=sys.stderr)
        result["servers"] = {
            n: {"throughput_rps": [x["throughput_rps"] for x in rows],
                "throughput_rps_median": round(statistics.median(x["throughput_rps"] for x in rows), 1),
                "p50_ms_median": round(statistics.median(x["p50_ms"] for x in rows), 2),
                "p99_ms_median": round(statistics.median(x["p99_ms"] for x in rows), 2),
                "errors": sum(x["errors"] + x["lost"] for x in rows),
                "server_cpu_ms_per_request": round(1e3 * sum(x["server_cpu_s"] for x in rows) / max(1, sum(x["requests"] for x in rows)), 3),
                "receiver_cpu_us_per_request": round(1e6 * sum(x["receiver_cpu_s"] for x in rows) / max(1, sum(x["requests"] for x in rows)), 1)}
            for n, rows in runs.items()
        }  # fmt: skip
        result["spans"] = measure(procs["on"][1], receiver, task, texts, 1, args.spans)  # benchmarks/trace_spans.py
        result["receiver_export_requests"] = receiver.requests
        result["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    finally:
        for proc, _ in procs.values():
            proc.send_signal(2)
        for proc, _ in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    record(args.out, "tracing", "Tracing (OpenTelemetry): its cost, and the spans of a request", result,
           lambda path: plot(result, path), markdown(result), not args.no_record)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
