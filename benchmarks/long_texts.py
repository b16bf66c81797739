"""Small requests beside clients posting ~900 KB texts (issue 30): each long text was tokenized whole, so small
requests beside them slowed from 7 ms to 216 ms p50, and with ``"strict": true`` the counting ran on the replica's
event loop, holding ``/healthz`` up to 1.1 s. Prints, for idle and for two long-text clients (plain, strict): the
small requests' p50 / p95, ``/healthz`` p50 / max, the long requests' rate and statuses.

    python -m benchmarks.long_texts ARTIFACT [--seconds 20] [--pythonpath OLD_TREE]

``--pythonpath`` runs the server from another checkout (its ``fusionserve`` package first on the path), to measure
the code before a change on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.httpload import closed_loop
from benchmarks.servers import ROOT, start_fusionserve
from fusionserve.serving.process.ports import free_port

HERE = Path(__file__).resolve().parent
SMALL = json.dumps({"task": "rte", "inputs": ["a fine film with a weak ending"]}).encode()


def _long(strict: bool) -> bytes:
    return json.dumps({"task": "rte", "inputs": ["word " * 180_000], "strict": strict}).encode()  # 900 KB


def _healthz(port: int, stop: threading.Event, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        started = time.perf_counter()
        conn.request("GET", "/healthz")
        conn.getresponse().read()
        out.append((time.perf_counter() - started) * 1000)
        time.sleep(0.02)
    conn.close()


def _paced(port: int, body: bytes, every_s: float, stop: threading.Event, out: dict) -> None:
    """One client posting ``body`` every ``every_s`` seconds (or as soon as the last answer came, if later)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not stop.is_set():
        started = time.perf_counter()
        conn.request("POST", "/v1/classify", body, {"content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        status = str(response.status)
        out[status] = out.get(status, 0) + 1
        stop.wait(max(0.0, every_s - (time.perf_counter() - started)))
    conn.close()


def phase(port: int, seconds: float, long_clients: int, strict: bool, every_s: float = 0.0) -> dict:
    """Small requests (1 client, closed loop) and /healthz polls for ``seconds``, beside ``long_clients`` clients
    posting 900 KB texts: as fast as answered (``every_s`` 0), or one every ``every_s`` seconds each."""
    stop, health = threading.Event(), []
    heavy: dict = {}
    threads = [threading.Thread(target=_healthz, args=(port, stop, health))]
    body = _long(strict)
    if long_clients and every_s:
        paced: dict = {}
        heavy = {"statuses": paced, "requests": 0, "seconds": seconds}
        threads += [threading.Thread(target=_paced, args=(port, body, every_s, stop, paced)) for _ in range(long_clients)]
    elif long_clients:

        def load() -> None:
            heavy.update(closed_loop(port, "/v1/classify", lambda i: body, long_clients, seconds + 1))

        threads.append(threading.Thread(target=load))
    for t in threads:
        t.start()
    time.sleep(0.5 if long_clients else 0)  # the long requests under way first
    small = closed_loop(port, "/v1/classify", lambda i: SMALL, 1, seconds)
    stop.set()
    for t in threads:
        t.join()
    if every_s and long_clients:
        heavy["requests"] = sum(heavy["statuses"].values())
    return {
        "small_p50_ms": small["p50_ms"],
        "small_p95_ms": small.get("p95_ms"),
        "small_statuses": small["statuses"],
        "healthz_p50_ms": round(float(np.median(health)), 2),
        "healthz_max_ms": round(max(health), 1),
        "long_per_s": round(heavy["requests"] / heavy["seconds"], 2) if heavy else None,
        "long_statuses": heavy.get("statuses"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--pythonpath", help="run the server with this checkout's fusionserve (the code before a change)")
    p.add_argument("--label", default="this tree")
    p.add_argument("--out", type=Path, default=HERE / "results" / "long_texts.json")
    args = p.parse_args(argv)
    cwd = Path(args.pythonpath) if args.pythonpath else ROOT
    if args.pythonpath:
        os.environ["PYTHONPATH"] = args.pythonpath  # the server's processes (Ray's too) inherit it
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    server = start_fusionserve(args.artifact.resolve(), free_port(), "haproxy", logs, threads=1, cwd=cwd)
    try:
        rows = {
            "idle": phase(server.port, args.seconds, 0, False),
            "2 clients of 900 KB texts": phase(server.port, args.seconds, 2, False),
            "2 clients of 900 KB texts, strict": phase(server.port, args.seconds, 2, True),
            # the long-text load the code before this change could serve at all (~0.5 a second in all)
            "2 clients of 900 KB texts, one every 4 s each": phase(server.port, args.seconds, 2, False, every_s=4.0),
        }
    finally:
        server.stop()
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    result = {"label": args.label, "cpu": cpu, "cores": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load, "python": platform.python_version(),
              "seconds": args.seconds, "rows": rows}  # fmt: skip
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    recorded = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps([*recorded, result], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
