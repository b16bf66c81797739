"""Whether a request's trace accounts for its time: requests with their own ``traceparent`` against one `fusionserve
serve` with tracing on (every request sampled, a real OTLP/HTTP receiver in this process: tests/oip_helpers.py), each
request's latency as its client measured it beside its root span and the sum of its stage spans (ingress, parse,
tokenize, queue, batch, respond) as the receiver got them; at 1 client (requests one after another: one request
alone) and at ``--clients`` (closed loop: each client sends its next request when its last one was answered).

The clients run in a process of their own (the receiver decodes exports in this one), on asyncio, over raw
keep-alive connections: a request's latency is from just before its bytes are written to its answer's last byte read.

    python -m benchmarks.trace_spans [ARTIFACT] [--ingress haproxy] [--requests 200] [--clients 16] [--per-client 25]

Writes benchmarks/results/tracing_spans.json, tracing_spans.png and the section in benchmarks/RESULTS.md
(``tracing_spans_proxy`` for ``--ingress proxy``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
ROOT_NAME = "POST /v1/classify"
STAGES = ("ingress", "parse", "tokenize", "queue", "batch", "respond")  # ingress: only where HAProxy stamped it


def _request(port: int, task: str, text: str, trace_id: str) -> bytes:
    body = json.dumps({"task": task, "inputs": [text]}).encode()
    head = (
        f"POST /v1/classify HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"traceparent: 00-{trace_id}-{os.urandom(8).hex()}-01\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _client(port: int, requests: list[tuple[str, bytes]]) -> list[tuple[str, float]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    measured = []
    try:
        for trace_id, data in requests:
            started = time.perf_counter()
            writer.write(data)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
            )
            await reader.readexactly(length)
            ms = (time.perf_counter() - started) * 1000
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"answered {head.split(b' ', 2)[1].decode()}: a benchmark request must succeed")
            measured.append((trace_id, ms))
    finally:
        writer.close()
    return measured


def _run_clients(port: int, per_client: list[list[tuple[str, bytes]]]) -> list[tuple[str, float]]:
    async def all_of_them() -> list[tuple[str, float]]:
        done = await asyncio.gather(*(_client(port, requests) for requests in per_client))
        return [row for rows in done for row in rows]

    return asyncio.run(all_of_them())


def measure(port: int, receiver: Any, task: str, texts: list[str], clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` clients of ``per_client`` requests each (in a process of their own); each request's client latency
    against its root span and its stages' sum. Returns the summary and the rows."""
    plan = [[(tid := os.urandom(16).hex(), _request(port, task, texts[(c * per_client + i) % len(texts)], tid))
             for i in range(per_client)] for c in range(clients)]  # fmt: skip
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        sent = pool.apply(_run_clients, (port, plan))
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    for trace_id, client_ms in sent:
        spans = {s.name: s for s in receiver.trace(trace_id, ROOT_NAME, within_s=30)}
        if ROOT_NAME not in spans or not {"parse", "respond"} <= set(spans):
            continue
        root = spans[ROOT_NAME]
        stage_ms = {s: round(spans[s].ms, 3) for s in STAGES if s in spans}
        rows.append({"client_ms": round(client_ms, 3), "root_ms": round(root.ms, 3),
                     "stages_ms": round(sum(stage_ms.values()), 3), "stage_ms": stage_ms})  # fmt: skip
    return summary(rows, clients, per_client, load_before, load_after)


def summary(rows: list[dict[str, Any]], clients: int, per_client: int, load_before: str, load_after: str) -> dict[str, Any]:
    med = statistics.median
    stages = [r["stages_ms"] / r["client_ms"] for r in rows]
    root = [r["root_ms"] / r["client_ms"] for r in rows]
    names = [s for s in STAGES if any(s in r["stage_ms"] for r in rows)]
    return {
        "clients": clients, "requests": clients * per_client, "traces_received": len(rows),
        "load_average_before": load_before, "load_average_after": load_after,
        "client_ms_median": round(med(r["client_ms"] for r in rows), 2),
        "root_ms_median": round(med(r["root_ms"] for r in rows), 2),
        "unaccounted_ms_median": round(med(r["client_ms"] - r["root_ms"] for r in rows), 3),
        "stages_over_client_median": round(med(stages), 3), "stages_over_client_min": round(min(stages), 3),
        "root_over_client_median": round(med(root), 3), "root_over_client_min": round(min(root), 3),
        "within_10pct_share": round(sum(x >= 0.9 and x <= 1.1 for x in stages) / len(stages), 3),
        "stage_ms_median": {s: round(med(r["stage_ms"].get(s, 0.0) for r in rows), 3) for s in names},
        "rows": rows,
    }  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"Command: `{r['command']}`",
        "",
        f"Machine: {m['cpu']} ({m['isa']}), {m['cores']} cores shared by the server, the clients and the receiver (and "
        f"other engineers' work); load average {m['load_average']} at the start, {r['load_average_end']} at the end; "
        f"{m['date']}. Task `{r['task']}` of `{r['artifact']}`, `--ingress {r['ingress']}`, tracing on (every request "
        "sampled, a real OTLP/HTTP receiver). Client latency: from just before a request's bytes are written to its "
        "answer's last byte read (raw keep-alive connections, asyncio, a process of their own).",
        "",
        "| clients | traces | load average (before, after) | client ms (median) | root ms (median) | client - root ms "
        "(median) | root / client (median, lowest) | stages / client (median, lowest) | stages within 10% |",
        "|---:|---:|---|---:|---:|---:|---|---|---:|",
    ]
    for s in r["runs"]:
        lines.append(
            f"| {s['clients']} | {s['traces_received']} of {s['requests']} | {s['load_average_before']}; "
            f"{s['load_average_after']} | {s['client_ms_median']} | {s['root_ms_median']} | {s['unaccounted_ms_median']} | "
            f"{s['root_over_client_median']}, {s['root_over_client_min']} | {s['stages_over_client_median']}, "
            f"{s['stages_over_client_min']} | {s['within_10pct_share']:.0%} |"
        )
    lines += ["", "Median ms of each stage span: " + "; ".join(
        f"{s['clients']} client(s): " + ", ".join(f"{k} {v}" for k, v in s["stage_ms_median"].items()) for s in r["runs"]
    ) + "."]  # fmt: skip
    lines += ["", "- The target (a request's spans add up to within 10% of its measured latency): " + "; ".join(
        f"{s['clients']} client(s): stages / client median {s['stages_over_client_median']} "
        f"({'met' if s['stages_over_client_median'] >= 0.9 else 'NOT met'})" for s in r["runs"]
    ) + "."]  # fmt: skip
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    data = [[row["stages_ms"] / row["client_ms"] for row in s["rows"]] for s in r["runs"]]
    ax.boxplot(data, tick_labels=[f"{s['clients']} client(s)" for s in r["runs"]])
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("stage spans' sum / client latency")
    ax.set_title("A request's spans against its measured latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.httpload import closed_loop
    from benchmarks.load import load_texts
    from benchmarks.report import machine, record
    from benchmarks.servers import artifact_and_task, body_maker
    from benchmarks.tracing import start
    from tests.oip_helpers import start_receiver

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", help="artifact folder (default: the built-in model)")
    p.add_argument("--task", help="task to ask (default: the first fusion task)")
    p.add_argument("--ingress", default="haproxy", help="the server's --ingress (default haproxy)")
    p.add_argument("--requests", type=int, default=200, help="requests one after another (1 client)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--per-client", type=int, default=25, help="requests of each of the --clients clients")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.artifact, task, _ = artifact_and_task(args.artifact, args.task)
    texts = load_texts("rotten_tomatoes")
    receiver, logs = start_receiver(), Path(tempfile.mkdtemp(prefix="fusionserve-trace-spans-"))
    result: dict[str, Any] = {"command": "python -m benchmarks.trace_spans " + " ".join(argv if argv is not None else sys.argv[1:]),
                              "machine": machine(), "task": task, "artifact": str(args.artifact), "ingress": args.ingress}  # fmt: skip
    extra = ["--otlp-endpoint", receiver.endpoint, "--trace-sample-ratio", "1", "--ingress", args.ingress]
    proc, port = start("on", args.artifact, logs, extra)
    try:
        closed_loop(port, "/v1/classify", body_maker(task, texts), args.clients, 3.0)  # warm-up
        time.sleep(1.0)
        result["runs"] = [measure(port, receiver, task, texts, 1, args.requests)]
        result["runs"].append(measure(port, receiver, task, texts, args.clients, args.per_client))
        result["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        result["receiver_export_requests"] = receiver.requests
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
    key = "tracing_spans" if args.ingress == "haproxy" else f"tracing_spans_{args.ingress}"
    title = "Tracing: a request's spans against its measured latency" + (
        "" if args.ingress == "haproxy" else f" (--ingress {args.ingress})"
    )
    record(args.out, key, title, result, lambda path: plot(result, path), markdown(result), not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
