"""HTTP load against the real server, for each ingress, beside a bare echo app and the model in-process, in one run.

    python -m benchmarks.load [ARTIFACT] [--ingress haproxy proxy haproxy-default proxy-throughput]
                              [--clients 1 4 16 64] [--seconds 15] [--texts rotten_tomatoes] [--soak SECONDS]
                              [--grpc-rounds 10] [--cost-rounds 5] [--cost-seconds 3]
                              [--oip-clients 1 16] [--oip-rounds 3] [--oip-seconds 10]

ARTIFACT defaults to the built-in model. For each ingress a fresh ``fusionserve serve`` (Ray reads its settings
when it starts) gets, after a warm-up, closed-loop clients (each sends its next request when the last one
answered, one real sentence per request, keep-alive) for ``--seconds`` per client count; p50/p95/p99, throughput,
errors, lost requests and the mean batch the server formed are recorded. With an HAProxy ingress the replica's
own port is measured too (1 client): what the replica costs without the ingress. Each server also serves gRPC
(Serve's gRPC ingress): ``--grpc-rounds`` rounds of 1-client HTTP and 1-client gRPC runs alternate against it, so
the two protocols' p50 are compared in one run (``benchmarks/grpcload.py``). Then a burst of simultaneous
requests far past the queue limit (how fast the excess is refused), and the time Ctrl-C takes. Beside them: a
bare uvicorn + FastAPI echo app (the floor of any Python HTTP server here) and the same texts through ONNX
Runtime in-process. ``--soak`` adds a long run at 16 clients with the memory of every server process at its
start and end.

The Open Inference Protocol is measured beside /v1/classify on each server (``benchmarks/oip.py``): ``--oip-rounds``
rounds of /v1/classify, OIP JSON and binary tensors (the same client), and Triton's own asyncio clients (HTTP and
gRPC), at each of ``--oip-clients``, the order rotating per round.

Then ``--cost-rounds`` rounds alternate the model in this process as the server runs it (batch 1, no spinning threads)
and one HTTP client against the idle server: what the server itself adds to a request, read in one run.

Writes benchmarks/results/load.json, load.png and the section in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import grpcload, oip, servers
from benchmarks.httpload import burst, closed_loop
from benchmarks.load_report import markdown, plot
from benchmarks.report import machine, record
from fusionserve.serving.process.ports import free_port

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


def in_process(
    artifact: Path, task: str, texts: list[str], batch_sizes: list[int], seconds: float, spin: bool = True, device: str = "cpu"
) -> dict:
    """Texts per second through OnnxRunner on ``device`` (tokenize + ONNX Runtime, every core), and the median time of
    a batch.
    ``spin``: idle ONNX Runtime threads busy-wait for the next run (the fastest a lone process gets); the server
    runs its session without spinning (its HTTP side needs the cores between runs), so ``spin=False`` is the model
    as served."""
    from fusionserve.serving.model.predictions import TextInput
    from fusionserve.serving.model.runtime import OnnxRunner

    runner = OnnxRunner(artifact, device=device, spin=spin)
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


def server_cost(port: int, artifact: Path, task: str, texts: list[str], rounds: int, seconds: float, device: str = "cpu") -> dict:
    """``rounds`` x (the model in this process as the server runs it, batch 1 without spinning threads; then one HTTP
    client against the idle server, the same texts; ``seconds`` each, the order alternating per round): the median over
    rounds of HTTP p50 - in-process p50 is what the server itself adds to one request."""
    from fusionserve.serving.model.predictions import TextInput
    from fusionserve.serving.model.runtime import OnnxRunner

    runner = OnnxRunner(artifact, device=device, spin=False)
    body = servers.body_maker(task, texts)

    def model_p50() -> float:
        times, i, stop_at = [], 0, time.perf_counter() + seconds
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            runner.logits(task, [TextInput(texts[i % len(texts)])])
            times.append((time.perf_counter() - t0) * 1000)
            i += 1
        return statistics.median(times)

    model_p50()  # warm-up
    model, http = [], []
    for r in range(rounds):
        for part in ("model", "http") if r % 2 == 0 else ("http", "model"):
            if part == "model":
                model.append(round(model_p50(), 2))
            else:
                http.append(closed_loop(port, "/v1/classify", body, 1, seconds)["p50_ms"])
    added = [h - m for h, m in zip(http, model, strict=True)]
    return {"rounds": rounds, "seconds_per_run": seconds, "model_p50_ms": model, "http_p50_ms": http,
            "added_ms_median": round(statistics.median(added), 2)}  # fmt: skip


def run_ingress(args: argparse.Namespace, ingress: str, task: str, texts: list[str], logs: Path) -> dict:
    """One fresh server with ``ingress``: every client count, the replica's own port, a burst, and Ctrl-C."""
    body = servers.body_maker(task, texts)
    grpc_port = free_port() if args.grpc_rounds else None
    server = servers.start_fusionserve(
        args.artifact, args.port, ingress, logs, args.replicas, args.device, args.max_batch_size, args.threads, grpc_port
    )
    print(f"load: {ingress} up in {server.started_s:.1f} s", file=sys.stderr)
    out: dict = {"startup_s": round(server.started_s, 1), "rows": []}
    try:
        closed_loop(server.port, "/v1/classify", body, 4, 3.0)  # warm-up
        for clients in args.clients:
            before = servers.batch_sums(server.port, task)
            row = closed_loop(server.port, "/v1/classify", body, clients, args.seconds)
            after = servers.batch_sums(server.port, task)
            row["mean_batch"] = round((after[0] - before[0]) / max(after[1] - before[1], 1), 2)
            out["rows"].append(row)
            print(f"  {ingress}, {clients} clients: {row}", file=sys.stderr)
        if args.oip_rounds:
            say = lambda text: print(text, file=sys.stderr)  # noqa: E731
            out["oip"] = oip.compare(
                server.port, grpc_port, task, texts, args.oip_clients, args.oip_seconds, args.oip_rounds, say
            )
        if grpc_port is not None:
            message = grpcload.messages(task, texts)
            grpcload.closed_loop_grpc(grpc_port, message, 1, 2.0)  # warm-up: the channel, the replica's gRPC server
            out["grpc_vs_http"] = grpcload.grpc_vs_http(
                server.port, grpc_port, body, message, args.grpc_rounds, args.grpc_seconds
            )
            print(f"  {ingress}, gRPC vs HTTP at 1 client: {out['grpc_vs_http']}", file=sys.stderr)
        if args.cost_rounds:
            out["server_cost"] = server_cost(
                server.port, args.artifact, task, texts, args.cost_rounds, args.cost_seconds, args.device
            )
            print(f"  {ingress}, the server's own cost at 1 client: {out['server_cost']}", file=sys.stderr)
        ports = servers.replica_ports(server.proc.pid) if ingress.startswith("haproxy") else []
        if ports:
            out["replica_port"] = closed_loop(ports[0], "/v1/classify", body, 1, args.seconds)
            print(f"  {ingress}, replica port {ports[0]}: {out['replica_port']}", file=sys.stderr)
        out["burst"] = burst(server.port, "/v1/classify", {"task": task, "inputs": texts[:8]}, args.burst)
        out["after_burst"] = closed_loop(server.port, "/v1/classify", body, 1, 2.0)["statuses"]
        print(f"  {ingress}, burst: {out['burst']}; after it: {out['after_burst']}", file=sys.stderr)
    finally:
        out["shutdown_s"] = round(server.stop(), 1)
    return out


def refusal_floor(args: argparse.Namespace, task: str, texts: list[str], logs: Path) -> dict:
    """The same burst against a server of the first ingress whose replica admits one waiting request
    (``--max-queued 1``): nearly every request takes the 503 path while the model is almost idle, so the slowest 503
    is what the server's refusal path alone costs for a burst of this size on this machine."""
    server = servers.start_fusionserve(
        args.artifact, args.port, args.ingress[0], logs, args.replicas, args.device, args.max_batch_size, args.threads,
        max_queued=1,
    )  # fmt: skip
    try:
        closed_loop(server.port, "/v1/classify", servers.body_maker(task, texts), 1, 2.0)  # warm-up
        return {"ingress": args.ingress[0]} | burst(server.port, "/v1/classify", {"task": task, "inputs": texts[:8]}, args.burst)
    finally:
        server.stop()


def soak(args: argparse.Namespace, task: str, texts: list[str], logs: Path) -> dict:
    """``--soak`` seconds at 16 clients on the first ingress, a row per minute, and every server process's memory."""
    body = servers.body_maker(task, texts)
    server = servers.start_fusionserve(
        args.artifact, args.port, args.ingress[0], logs, args.replicas, args.device, args.max_batch_size, args.threads
    )
    try:
        closed_loop(server.port, "/v1/classify", body, 16, 10.0)  # warm-up: sessions, arenas, caches
        start_rss = servers.tree_rss_mb(server.proc.pid)
        minutes = []
        left = args.soak
        while left > 0:
            minutes.append(closed_loop(server.port, "/v1/classify", body, 16, min(60.0, left)))
            left -= 60
            print(
                f"  soak minute {len(minutes)}: {minutes[-1]['throughput_rps']} req/s, errors {minutes[-1]['errors']}",
                file=sys.stderr,
            )
        end_rss = servers.tree_rss_mb(server.proc.pid)
    finally:
        server.stop()
    return {
        "ingress": args.ingress[0],
        "seconds": args.soak,
        "minutes": minutes,
        "rss_start_mb": start_rss,
        "rss_end_mb": end_rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", help="artifact folder (default: the built-in model)")
    p.add_argument("--ingress", nargs="+", default=["haproxy", "proxy"], help="ingresses to compare (first: the soak's)")
    p.add_argument("--task", help="task to load (default: the first fusion task)")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--seconds", type=float, default=15.0, help="per client count")
    p.add_argument("--texts", default="rotten_tomatoes", help="dataset whose test texts are sent")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--threads", type=int, help="ONNX Runtime threads per replica (default: the server's, CPUs / replicas)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--burst", type=int, default=300, help="simultaneous requests of the overload burst")
    p.add_argument(
        "--no-burst-floor", dest="burst_floor", action="store_false",
        help="skip the burst against a server admitting one waiting request (the refusal path's own cost)",
    )  # fmt: skip
    p.add_argument("--soak", type=float, default=0.0, help="seconds of a soak run at 16 clients (0: none)")
    p.add_argument("--grpc-rounds", type=int, default=10, help="rounds of 1-client HTTP vs gRPC runs per server (0: no gRPC)")
    p.add_argument("--grpc-seconds", type=float, default=3.0, help="seconds of each run in those rounds")
    p.add_argument(
        "--cost-rounds", type=int, default=5, help="rounds of in-process (as served) vs 1-client HTTP per server (0: none)"
    )
    p.add_argument("--cost-seconds", type=float, default=3.0, help="seconds of each run in those rounds")
    p.add_argument("--oip-clients", nargs="+", type=int, default=[1, 16], help="client counts of the OIP comparison")
    p.add_argument("--oip-rounds", type=int, default=3, help="rounds of the OIP comparison per server (0: none)")
    p.add_argument("--oip-seconds", type=float, default=10.0, help="seconds of each run in those rounds")
    p.add_argument("--render-only", action="store_true", help="redo table and plot from the recorded results/load.json")
    p.add_argument(
        "--soak-only", action="store_true", help="run only the soak (--soak seconds) and add it to the recorded results/load.json"
    )
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.render_only:
        result = json.loads((args.out / "load.json").read_text())
        write_md = not args.no_record
        record(args.out, "load", "Load (HTTP, Ray Serve)", result, lambda path: plot(result, path), markdown(result), write_md)
        return 0
    args.artifact, task, _ = servers.artifact_and_task(args.artifact, args.task)
    texts = load_texts(args.texts)
    logs = Path(tempfile.mkdtemp(prefix="fusionserve-load-"))
    if args.soak_only:  # a long run kept apart from the comparison (it may run while the machine does other work)
        result = json.loads((args.out / "load.json").read_text())
        result["soak"] = soak(args, task, texts, logs)
        result["soak"]["command"] = "python -m benchmarks.load " + " ".join(argv if argv is not None else sys.argv[1:])
        record(args.out, "load", "Load (HTTP, Ray Serve)", result, lambda path: plot(result, path), markdown(result), True)
        return 0
    result: dict = {
        "command": "python -m benchmarks.load " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "task": task,
        "artifact": str(args.artifact),
        "seconds": args.seconds,
        "replicas": args.replicas,
        "threads": args.threads,
        "max_batch_size": args.max_batch_size,
        "device": args.device,
    }
    echo = servers.start_echo(args.port, logs)
    try:
        result["echo"] = [
            closed_loop(echo.port, "/v1/classify", servers.body_maker(task, texts), c, args.seconds) for c in (1, 16)
        ]
        # the same burst answered by an app that does nothing: what fresh connections cost the client and this machine
        result["echo_burst"] = burst(echo.port, "/v1/classify", {"task": task, "inputs": texts[:8]}, args.burst)
    finally:
        echo.stop()
    print(f"load: echo {result['echo']}", file=sys.stderr)
    result["ingress"] = {ing: run_ingress(args, ing, task, texts, logs) for ing in args.ingress}
    if args.burst_floor:
        result["refusal_floor"] = refusal_floor(args, task, texts, logs)
        print(f"load: the burst against a replica refusing nearly all: {result['refusal_floor']}", file=sys.stderr)
    # on the device the server runs on (the CUDA comparison on an H100 first compared against the CPU in-process)
    result["in_process"] = in_process(args.artifact, task, texts, [1, 4, 8, 16, 32], min(args.seconds, 10), device=args.device)
    result["in_process_served"] = in_process(
        args.artifact, task, texts, [1, 8], min(args.seconds, 10), spin=False, device=args.device
    )
    print(f"load: in-process {result['in_process']}; as served (no spinning) {result['in_process_served']}", file=sys.stderr)
    if args.soak:
        result["soak"] = soak(args, task, texts, logs)
    elif (args.out / "load.json").is_file():  # a soak run apart (--soak-only) stays recorded until the next soak
        kept = json.loads((args.out / "load.json").read_text()).get("soak")
        if kept is not None:
            result["soak"] = kept | {"command": kept.get("command", "an earlier run")}
    record(
        args.out, "load", "Load (HTTP, Ray Serve)", result, lambda path: plot(result, path), markdown(result), not args.no_record
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
