"""The Open Inference Protocol beside /v1/classify in the load benchmark: on one server, rounds of closed-loop runs
of each mode in turn (the order rotating per round), so the ratios are read in one run on a shared, noisy machine:

- ``classify``: POST /v1/classify (JSON), the route the others are compared with;
- ``oip_json``, ``oip_binary``: POST /v2/models/{task}/infer, JSON tensors, and Triton's binary tensor data
  extension (a JSON header, then the BYTES tensor), through the same raw-socket client as ``classify``;
- ``tritonclient_http``, ``tritonclient_grpc``: Triton's own asyncio clients (binary tensors, as they send them by
  default), in the tritonclient environment (``benchmarks/triton_load.py``): what a user of Triton's client sees,
  the client's own cost on these shared cores included.

Each request holds one real sentence; each mode answers ``label`` and ``scores``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.httpload import closed_loop
from benchmarks.servers import body_maker

HERE = Path(__file__).parent
MODES = ("classify", "oip_json", "oip_binary", "tritonclient_http", "tritonclient_grpc")


def _raw(texts: list[str]) -> list[bytes]:
    """Each text as a one-element BYTES tensor's raw data (a 4-byte little-endian length, then the UTF-8 bytes)."""
    return [len(t.encode()).to_bytes(4, "little") + t.encode() for t in texts]


def json_bodies(texts: list[str]) -> Callable[[int], bytes]:
    """Request ``i`` holds text ``i`` as a JSON BYTES tensor [1, 1]."""
    encoded = [
        json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [t]}]}).encode() for t in texts
    ]
    return lambda i: encoded[i % len(encoded)]


def binary_bodies(texts: list[str]) -> Callable[[int], tuple[bytes, bytes]]:
    """Request ``i``: text ``i`` in the binary extension (the JSON header, then the tensor; its length in a header),
    both outputs asked in binary, as tritonclient asks by default."""
    made = []
    for raw in _raw(texts):
        head = json.dumps({
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": len(raw)}}],
            "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in ("label", "scores")],
        }).encode()  # fmt: skip
        made.append((head + raw, f"Inference-Header-Content-Length: {len(head)}\r\n".encode()))
    return lambda i: made[i % len(made)]


def triton_closed_loop(url: str, task: str, texts: list[str], clients: int, seconds: float, protocol: str) -> dict[str, Any]:
    """tritonclient's asyncio client, ``clients`` at once for ``seconds``, in its own environment."""
    from tests import triton_env

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(texts[:500], f)
        f.flush()
        cmd = [str(triton_env.python()), str(HERE / "triton_load.py"), url, task, f.name, str(clients), str(seconds), protocol]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(mode: str, port: int, grpc_port: int | None, task: str, texts: list[str], clients: int, seconds: float) -> dict:
    path = f"/v2/models/{task}/infer"
    if mode == "classify":
        return closed_loop(port, "/v1/classify", body_maker(task, texts), clients, seconds)
    if mode == "oip_json":
        return closed_loop(port, path, json_bodies(texts), clients, seconds)
    if mode == "oip_binary":
        return closed_loop(port, path, binary_bodies(texts), clients, seconds)
    protocol = mode.rsplit("_", 1)[1]
    url = f"127.0.0.1:{grpc_port if protocol == 'grpc' else port}"
    return triton_closed_loop(url, task, texts, clients, seconds, protocol)


def compare(
    port: int, grpc_port: int | None, task: str, texts: list[str], clients: list[int], seconds: float, rounds: int, say: Any
) -> dict[str, Any]:
    """``rounds`` rounds of every mode at each client count (the order rotating); per mode and count: every run, and
    the medians of throughput, p50 and p99; with the ratio of each mode's median throughput to ``classify``'s."""
    modes = [m for m in MODES if grpc_port is not None or m != "tritonclient_grpc"]
    out: dict[str, Any] = {"seconds": seconds, "rounds": rounds, "by_clients": {}}
    for n in clients:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(rounds):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                runs[mode].append(_run(mode, port, grpc_port, task, texts, n, seconds))
                say(f"  OIP round {r + 1}, {n} clients, {mode}: {runs[mode][-1]['throughput_rps']} req/s")
        summary = {}
        for mode, rows in runs.items():
            summary[mode] = {
                "throughput_rps": round(statistics.median(x["throughput_rps"] for x in rows), 1),
                "p50_ms": round(statistics.median(x["p50_ms"] or 0 for x in rows), 2),
                "p99_ms": round(statistics.median(x["p99_ms"] or 0 for x in rows), 2),
                "errors": sum(x["errors"] + x["lost"] for x in rows),
                "runs": rows,
            }
        base = summary["classify"]["throughput_rps"] or 1
        for mode in modes:
            summary[mode]["vs_classify"] = round(summary[mode]["throughput_rps"] / base, 3)
        out["by_clients"][str(n)] = summary
    return out


def markdown(oip: dict[str, Any]) -> list[str]:
    """The section's table: every mode at every client count, medians over the rounds."""
    lines = [
        f"Open Inference Protocol beside /v1/classify on the same server ({oip['rounds']} rounds of {oip['seconds']:g} s "
        "per mode, the order rotating; medians):",
        "",
        "| clients | mode | req/s | vs /v1/classify | p50 (ms) | p99 (ms) | errors |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n, summary in oip["by_clients"].items():
        for mode, v in summary.items():
            lines.append(
                f"| {n} | {mode} | {v['throughput_rps']} | {v['vs_classify']:.3f} | {v['p50_ms']} | {v['p99_ms']} | {v['errors']} |"
            )
    return lines
