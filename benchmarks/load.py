"""HTTP load against the real server, with an in-process baseline and a no-op deployment, in one run.

    python -m benchmarks.load ARTIFACT [--task T] [--clients 1 4 16 64] [--seconds 20] [--texts rotten_tomatoes]

Starts Ray Serve on 127.0.0.1 with fusionserve's application and, beside it, a no-op deployment (same proxy, no
model) whose round trip is the floor any Serve deployment pays here. Then, for each client count, closed-loop
clients (each sends its next request when the last one answered, one text per request, keep-alive) run for a
fixed time; p50/p95/p99 latency, throughput and errors are recorded. In the same process the same texts go
through ONNX Runtime directly (batch 1 and the batch sizes the server formed) for comparison. Finally a burst
far past the queue limits checks that overload is answered 503.

Writes benchmarks/results/load.json, benchmarks/results/load.png and the section in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.report import machine, record

HERE = Path(__file__).parent
FALLBACK_TEXTS = [
    "A gripping, beautifully shot film that never loses its nerve.",
    "The plot meanders for two hours and the jokes land with a thud.",
    "Shares of the retailer fell sharply after the company cut its forecast.",
    "The striker scored twice as the home side came back to win 3-2.",
    "I ordered these for my dog and he would not touch them.",
    "Parliament voted late on Tuesday to extend the emergency measures.",
]


def load_texts(name: str, limit: int = 2000) -> list[str]:
    """Real sentences from a training dataset (fetched and cached on first use), else a small built-in set."""
    try:
        from fusionserve.training.datasets import load

        ds = load(name)
        return [ex.text for ex in ds.test[:limit]]
    except Exception as exc:  # the benchmark still runs, and says what it used
        print(f"load: using built-in sentences ({type(exc).__name__}: {exc})", file=sys.stderr)
        return FALLBACK_TEXTS


class Client:
    """One keep-alive HTTP connection."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=60)

    def post(self, path: str, body: dict) -> tuple[int, float]:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self.conn.request("POST", path, data, {"content-type": "application/json"})
        resp = self.conn.getresponse()
        resp.read()
        return resp.status, (time.perf_counter() - t0) * 1000


def closed_loop(port: int, path: str, make_body, clients: int, seconds: float) -> dict:
    """``clients`` threads, each sending requests back to back for ``seconds``."""
    stop_at = time.perf_counter() + seconds
    lat: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    sent = [0]

    def worker(k: int) -> None:
        c = Client("127.0.0.1", port)
        i = k
        while time.perf_counter() < stop_at:
            with lock:
                sent[0] += 1
            try:
                status, ms = c.post(path, make_body(i))
            except OSError:
                status, ms = -1, 0.0
                c = Client("127.0.0.1", port)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    lat.append(ms)
            i += clients

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    answered = sum(statuses.values())
    return {
        "clients": clients,
        "seconds": round(wall, 2),
        "requests": answered,
        "lost": sent[0] - answered,
        "errors": answered - statuses.get(200, 0),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "throughput_rps": round(statuses.get(200, 0) / wall, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat else None,
        "p95_ms": round(float(np.percentile(lat, 95)), 2) if lat else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat else None,
    }


def in_process(artifact: Path, task: str, texts: list[str], batch_sizes: list[int], threads: int, seconds: float) -> dict:
    """Texts per second through OnnxRunner (tokenize + ONNX Runtime), and the median time of one batch."""
    from fusionserve.serving.predictions import TextInput
    from fusionserve.serving.runtime import OnnxRunner

    runner = OnnxRunner(artifact, threads=threads, device="cpu")
    out = {}
    for b in batch_sizes:
        times, i = [], 0
        stop_at = time.perf_counter() + seconds
        runner.logits(task, [TextInput(t) for t in texts[:b]])  # warm-up
        while time.perf_counter() < stop_at:
            batch = [TextInput(texts[(i + k) % len(texts)]) for k in range(b)]
            t0 = time.perf_counter()
            runner.logits(task, batch)
            times.append((time.perf_counter() - t0) * 1000)
            i += b
        med = statistics.median(times)
        out[str(b)] = {"median_batch_ms": round(med, 2), "texts_per_s": round(b * 1000 / med, 1), "runs": len(times)}
    return out


def burst(port: int, task: str, text: str, n: int) -> dict:
    """``n`` simultaneous requests of 8 texts each: past the queue limits, the excess must get 503 at once."""

    def one(_: int) -> tuple[int, float]:
        return Client("127.0.0.1", port).post("/v1/classify", {"task": task, "inputs": [text] * 8})

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(one, range(n)))
    refused = [ms for s, ms in answers if s == 503]
    return {
        "requests": n,
        "statuses": {str(s): sum(1 for a, _ in answers if a == s) for s in sorted({a for a, _ in answers})},
        "max_503_ms": round(max(refused), 1) if refused else None,
    }


def batch_sizes_formed(port: int, task: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == "fusionserve_batch_size_inputs":
            vals = {s.name: s.value for s in fam.samples if s.labels.get("task") == task}
            return vals.get("fusionserve_batch_size_inputs_sum", 0) / max(vals.get("fusionserve_batch_size_inputs_count", 1), 1)
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", help="artifact folder (not needed with --render-only)")
    p.add_argument("--render-only", action="store_true", help="redo table and plot from the recorded results/load.json")
    p.add_argument("--task", help="task to load (default: the first fusion task)")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--seconds", type=float, default=20.0, help="per client count")
    p.add_argument("--texts", default="rotten_tomatoes", help="dataset whose test texts are sent")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--batch-wait-ms", type=float, default=2.0)
    p.add_argument("--max-ongoing", type=int, help="requests a replica holds at once (default: the server's)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.render_only:
        result = json.loads((args.out / "load.json").read_text())
        text = markdown(result, result["command"])
        record(args.out, "load", "Load (HTTP, Ray Serve)", result, lambda path: plot(result, path), text, True)
        return 0
    if args.artifact is None:
        p.error("give the artifact folder to serve")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from ray import serve

    from fusionserve.serving.artifact import load_artifact
    from fusionserve.serving.server import ServerConfig, start, stop

    art = load_artifact(args.artifact)
    task = args.task or next((n for n, t in art.tasks.items() if t.kind == "fusion"), next(iter(art.tasks)))
    texts = load_texts(args.texts)
    cfg = ServerConfig(
        args.artifact,
        port=args.port,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_ongoing=args.max_ongoing,
    )
    command = "python -m benchmarks.load " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"load: starting the server ({task}, {len(texts)} texts)", file=sys.stderr)
    start(cfg)

    @serve.deployment(name="noop", max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
    class NoOp:
        async def __call__(self, request) -> dict:
            await request.body()
            return {"ok": True}

    serve.run(NoOp.bind(), name="noop", route_prefix="/noop")
    result: dict = {
        "command": command,
        "machine": machine(),
        "task": task,
        "artifact": str(args.artifact),
        "config": vars(cfg) | {"artifact": str(cfg.artifact)},
    }
    try:
        body = lambda i: {"task": task, "inputs": [texts[i % len(texts)]]}  # noqa: E731
        closed_loop(args.port, "/v1/classify", body, 4, 3.0)  # warm-up
        result["noop"] = closed_loop(args.port, "/noop", body, 1, args.seconds)
        print(f"  noop: {result['noop']}", file=sys.stderr)
        # the ceiling of Serve itself on this machine: the no-op under the same 16 clients
        result["noop_16"] = closed_loop(args.port, "/noop", body, 16, args.seconds)
        print(f"  noop, 16 clients: {result['noop_16']}", file=sys.stderr)
        result["http"] = []
        for c in args.clients:
            r = closed_loop(args.port, "/v1/classify", body, c, args.seconds)
            r["mean_batch_inputs_so_far"] = round(batch_sizes_formed(args.port, task), 2)
            result["http"].append(r)
            print(f"  {c} clients: {r}", file=sys.stderr)
        result["burst"] = burst(args.port, task, texts[0], 200)
        print(f"  burst: {result['burst']}", file=sys.stderr)
    finally:
        stop()
    sizes = sorted({1, 4, args.max_batch_size})
    result["in_process"] = in_process(args.artifact, task, texts, sizes, cfg.threads_per_replica, min(args.seconds, 10))
    print(f"  in-process: {result['in_process']}", file=sys.stderr)

    text = markdown(result, command.strip())
    record(args.out, "load", "Load (HTTP, Ray Serve)", result, lambda path: plot(result, path), text, not args.no_record)
    return 0


def markdown(r: dict, command: str) -> str:
    m = r["machine"]
    one = next(x for x in r["http"] if x["clients"] == 1) if any(x["clients"] == 1 for x in r["http"]) else None
    ip = r["in_process"]
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (server, clients and Ray share them); {m['python']}, onnxruntime {m['onnxruntime']}; "
        f"{m['date']}. Task `{r['task']}` of `{r['artifact']}`, one text per request, {r['http'][0]['seconds']:.0f} s per row, "
        f"max batch {r['config']['max_batch_size']}, batch wait {r['config']['batch_wait_ms']} ms.",
        "",
        "| clients | requests | errors | lost | throughput (req/s) | p50 (ms) | p95 (ms) | p99 (ms) | mean batch so far |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["http"]:
        lines.append(
            f"| {x['clients']} | {x['requests']} | {x['errors']} | {x['lost']} | {x['throughput_rps']} | {x['p50_ms']} | {x['p95_ms']} | {x['p99_ms']} | {x['mean_batch_inputs_so_far']} |"
        )
    n = r["noop"]
    lines += [
        "",
        f"No-op deployment through the same proxy, 1 client: p50 {n['p50_ms']} ms, p95 {n['p95_ms']} ms ({n['requests']} requests).",
    ]
    if "noop_16" in r:
        m16 = r["noop_16"]
        lines.append(
            f"No-op, 16 clients: {m16['throughput_rps']} req/s, p50 {m16['p50_ms']} ms — what Serve's proxy and the Python "
            "clients alone sustain on these cores, before any model work."
        )
    lines += [""]
    lines += ["| in-process batch | median batch (ms) | texts/s |", "|---:|---:|---:|"]
    lines += [f"| {b} | {v['median_batch_ms']} | {v['texts_per_s']} |" for b, v in ip.items()]
    if one:
        budget = ip["1"]["median_batch_ms"] + n["p50_ms"] + 1
        lines += [
            "",
            f"Target 1: p50 at 1 client {one['p50_ms']} ms vs in-process {ip['1']['median_batch_ms']} + no-op {n['p50_ms']} + 1 = {budget:.2f} ms: {'met' if one['p50_ms'] <= budget else 'NOT met'}.",
        ]
    sixteen = next((x for x in r["http"] if x["clients"] == 16), None)
    if sixteen:
        best = max(v["texts_per_s"] for v in ip.values())
        lines.append(
            f"Target 2: throughput at 16 clients {sixteen['throughput_rps']} req/s vs best in-process {best} texts/s: {sixteen['throughput_rps'] / best:.0%} (target >= 80%)."
        )
    errs = sum(x["errors"] + x["lost"] for x in r["http"])
    lines.append(
        f"Target 3: errors + lost over all rows: {errs}. Overload burst of {r['burst']['requests']} x 8 texts: {r['burst']['statuses']}, slowest 503 in {r['burst']['max_503_ms']} ms."
    )
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x["clients"] for x in r["http"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("p50_ms", "o-"), ("p95_ms", "s--"), ("p99_ms", "^:")):
        a.plot(xs, [x[key] for x in r["http"]], style, label=key.replace("_ms", ""))
    a.axhline(r["noop"]["p50_ms"], color="gray", linestyle=":", label="no-op p50")
    a.set(xscale="log", xlabel="concurrent clients", ylabel="latency (ms)", title="HTTP latency")
    a.legend()
    b.plot(xs, [x["throughput_rps"] for x in r["http"]], "o-", label="HTTP (req/s, 1 text each)")
    for bs, v in r["in_process"].items():
        b.axhline(v["texts_per_s"], linestyle=":", color="gray")
        b.text(xs[0], v["texts_per_s"], f" in-process batch {bs}", va="bottom", fontsize=8)
    b.set(xscale="log", xlabel="concurrent clients", ylabel="texts per second", title="Throughput")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
