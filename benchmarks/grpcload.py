"""gRPC beside HTTP in the load benchmark: closed-loop gRPC clients (one channel each, the metadata
``application: fusionserve``), and a round-robin of 1-client HTTP and gRPC runs against the same server, so the two
are compared in one run on a shared, noisy machine."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import grpc

from benchmarks.httpload import Tally, closed_loop
from fusionserve.serving import fusionserve_pb2 as pb
from fusionserve.serving import fusionserve_pb2_grpc as pb_grpc

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
