"""gRPC beside HTTP in the load benchmark: closed-loop gRPC clients (one channel each, the metadata
``application: fusionserve``), and a round-robin of 1-client HTTP and gRPC runs against the same server, so the two
are compared in one run on a shared, noisy machine.

Run on its own, it splits that comparison by hop: one ``fusionserve serve`` (HAProxy ingress, gRPC on), and
1-client runs of HTTP and gRPC through HAProxy and straight to the replica's own ports (Serve's direct ingress:
HTTP 30000-31000, gRPC 40000-41000), the four in turn, round by round:

    python -m benchmarks.grpcload ARTIFACT [--task T] [--rounds 6] [--seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from benchmarks import servers
from benchmarks.httpload import Tally, closed_loop
from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api import fusionserve_pb2_grpc as pb_grpc
from fusionserve.serving.process.ports import free_port

METADATA = (("application", "fusionserve"),)


def messages(task: str, texts: list[str]) -> Callable[[int], pb.ClassifyRequest]:
    """The gRPC twin of ``servers.body_maker``: request ``i`` holds text ``i``."""
    encoded = [pb.ClassifyRequest(task=task, inputs=[pb.Input(text=t)]) for t in texts]
    return lambda i: encoded[i % len(encoded)]


def closed_loop_grpc(port: int, message: Callable[[int], pb.ClassifyRequest], clients: int, seconds: float) -> dict:
    """``clients`` gRPC channels, each sending its next call as soon as the last one answered, for ``seconds``. Each
    client is a thread with the blocking stub: the call waits in gRPC's C core, the lightest Python client there is
    (grpc.aio's event loop adds its own overhead per call, as an HTTP library would; the HTTP side uses raw sockets)."""
    tally, lock = Tally(), threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(k: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub, i = pb_grpc.ClassifierStub(channel), k
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    _, call = stub.Classify.with_call(message(i), metadata=METADATA, timeout=60)
                    status, trailer = 200, dict(call.trailing_metadata() or ())  # 200: counted as HTTP counts a success
                except grpc.RpcError as err:
                    status, trailer = -err.code().value[0], {}  # the negated gRPC code: never a 200
                ms = (time.perf_counter() - started) * 1000
                with lock:
                    tally.sent += 1
                    tally.statuses[status] = tally.statuses.get(status, 0) + 1
                    if status == 200:
                        tally.latencies_ms.append(ms)
                        replica = str(trailer.get("fusionserve-replica", "-"))
                        tally.replicas[replica] = tally.replicas.get(replica, 0) + 1
                i += clients

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally.summary(clients, time.perf_counter() - started)


def grpc_vs_http(
    port: int,
    grpc_port: int,
    body: Callable[[int], bytes],
    message: Callable[[int], pb.ClassifyRequest],
    rounds: int,
    seconds: float,
) -> dict:
    """``rounds`` x (1 HTTP client, then 1 gRPC client, ``seconds`` each, the order alternating per round): each
    protocol's p50 per round and their median, and the median over rounds of gRPC p50 / HTTP p50."""
    runs: dict[str, list[dict]] = {"http": [], "grpc": []}
    for r in range(rounds):
        order = ("http", "grpc") if r % 2 == 0 else ("grpc", "http")
        for proto in order:
            if proto == "http":
                runs[proto].append(closed_loop(port, "/v1/classify", body, 1, seconds))
            else:
                runs[proto].append(closed_loop_grpc(grpc_port, message, 1, seconds))
    ratios = [g["p50_ms"] / h["p50_ms"] for g, h in zip(runs["grpc"], runs["http"], strict=True) if g["p50_ms"] and h["p50_ms"]]
    out: dict = {"rounds": rounds, "seconds_per_run": seconds, "ratio_p50_median": round(statistics.median(ratios), 3)}
    for proto, rows in runs.items():
        p50s = [x["p50_ms"] for x in rows if x["p50_ms"] is not None]
        out[proto] = {
            "requests": sum(x["requests"] for x in rows),
            "errors": sum(x["errors"] + x["lost"] for x in rows),
            "p50_ms_per_round": p50s,
            "p50_ms_median_of_rounds": round(statistics.median(p50s), 2),
        }
    return out


def _replica(pid: int) -> tuple[Any, int]:
    """The server's replica process and its direct-ingress gRPC port (Serve's range 40000-41000)."""
    import psutil

    replica = next((p for p in psutil.Process(pid).children(recursive=True) if "ServeReplica" in " ".join(p.cmdline())), None)
    if replica is None:
        raise RuntimeError("no replica below the server")
    ports = [c.laddr.port for c in replica.net_connections("tcp") if c.status == "LISTEN" and 40000 <= c.laddr.port < 41000]
    if not ports:
        raise RuntimeError("the replica listens on no port in 40000-41000 (Serve's direct-ingress gRPC range)")
    return replica, min(ports)


def _cpu_s(proc: Any) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def _haproxy_cpu_s(pid: int) -> tuple[frozenset[int], float]:
    """The HAProxy processes below the server and their CPU seconds (Serve reloads HAProxy: a new process)."""
    import psutil

    procs = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "haproxy"]
    return frozenset(p.pid for p in procs), sum(_cpu_s(p) for p in procs)


def by_hop(artifact: Path, task: str | None, rounds: int, seconds: float) -> dict[str, dict[str, list[float]]]:
    """Per route (HTTP or gRPC, through HAProxy or at the replica's own port), each round's 1-client p50 (ms) and
    the CPU milliseconds per request of the client (this process), the replica and HAProxy."""
    from fusionserve.serving.model.artifact import load_artifact

    task = task or next(iter(load_artifact(artifact).tasks))
    texts = ["the plot is thin but the actors carry it well enough to keep you watching"]
    body, message = servers.body_maker(task, texts), messages(task, texts)
    grpc_port = free_port()
    server = servers.start_fusionserve(artifact, free_port(), "haproxy", Path(tempfile.mkdtemp(prefix="grpcload-")),
                                       grpc_port=grpc_port)  # fmt: skip
    try:
        (http_direct,) = servers.replica_ports(server.proc.pid)
        replica, grpc_direct = _replica(server.proc.pid)
        routes: dict[str, Callable[[], dict]] = {
            "HTTP, HAProxy": lambda: closed_loop(server.port, "/v1/classify", body, 1, seconds),
            "gRPC, HAProxy": lambda: closed_loop_grpc(grpc_port, message, 1, seconds),
            "HTTP, replica port": lambda: closed_loop(http_direct, "/v1/classify", body, 1, seconds),
            "gRPC, replica port": lambda: closed_loop_grpc(grpc_direct, message, 1, seconds),
        }
        for run in routes.values():  # warm-up: connections, channels, the replica's servers
            run()
        out: dict[str, dict[str, list[float]]] = {
            n: {"p50_ms": [], "failed": [], "client": [], "replica": [], "haproxy": []} for n in routes
        }
        names = list(routes)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each route leads in turn
                before, ha_before = (time.process_time(), _cpu_s(replica)), _haproxy_cpu_s(server.proc.pid)
                row = routes[name]()
                after, ha_after = (time.process_time(), _cpu_s(replica)), _haproxy_cpu_s(server.proc.pid)
                out[name]["p50_ms"].append(row["p50_ms"])
                out[name]["failed"].append(row["errors"] + row["lost"])
                if row["errors"] or row["lost"]:
                    print(f"grpcload: {name}, round {r}: {row['statuses']}, lost {row['lost']}", file=sys.stderr)
                for key, b, a in zip(("client", "replica"), before, after, strict=True):
                    out[name][key].append((a - b) * 1000 / row["requests"])
                if ha_before[0] == ha_after[0]:  # not reloaded in between
                    out[name]["haproxy"].append((ha_after[1] - ha_before[1]) * 1000 / row["requests"])
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="gRPC and HTTP at 1 client, through HAProxy and at the replica's own ports")
    p.add_argument("artifact", type=Path)
    p.add_argument("--task", help="default: the artifact's first task")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=2.0, help="per route and round")
    args = p.parse_args(argv)
    runs = by_hop(args.artifact, args.task, args.rounds, args.seconds)
    print("| route | p50 (ms), median of rounds | per round | failed | CPU ms per request: client / replica / HAProxy |")
    print("|---|---:|---|---:|---|")
    for name, v in runs.items():
        cpu = " / ".join(f"{statistics.median(v[k]):.2f}" if v[k] else "-" for k in ("client", "replica", "haproxy"))
        print(
            f"| {name} | {statistics.median(v['p50_ms']):.2f} | {', '.join(f'{x:.2f}' for x in v['p50_ms'])} | {sum(v['failed'])} | {cpu} |"
        )
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(runs[a]["p50_ms"], runs[b]["p50_ms"], strict=True))  # noqa: E731
    print(f"gRPC / HTTP, median of per-round ratios: through HAProxy {ratio('gRPC, HAProxy', 'HTTP, HAProxy'):.3f}, "
          f"at the replica's ports {ratio('gRPC, replica port', 'HTTP, replica port'):.3f}", file=sys.stdout)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
