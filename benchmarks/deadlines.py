"""Deadlines against a busy server: a burst of requests with a short deadline (``timeout_ms``) while other clients
keep the model busy. Every burst request the model has not taken by its deadline must be answered 504
``deadline_exceeded`` at its deadline, and the model must run none of them.

    python -m benchmarks.deadlines [--artifact ART] [--burst 300] [--deadline-ms 50] [--busy-clients 4] [--port 8460]

Without ``--artifact`` it builds MiniLM (real weights, 6 layers, hidden 384) with 4 seq_bn adapters and 2 fusion
tasks (AdapterHub's own save functions), exported at 128 tokens, under /tmp. The busy clients send ``task0``
requests of 32 inputs of about 120 tokens, no deadline, back to back; the burst sends ``task1`` requests of one
short text each, all at once. What the model ran of the burst is read from the server's own counter
(``fusionserve_inputs_total{task="task1"}``): it must equal the burst's 200 answers. How quickly a 504 comes is
given twice: in the replica (its request-duration histogram: arrival to answer) and at the client (which adds the
300 client threads' own connection set-up through HAProxy on the same cores). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.servers import start_fusionserve

LONG = " ".join(["the plot is thin but the actors carry it well enough to keep you watching until the end"] * 7)


def _post(port: int, body: dict[str, Any], timeout_s: float = 120) -> tuple[int, float, str]:
    """(status, seconds, error type or "")."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/classify", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    kind = json.loads(data).get("error", {}).get("type", "") if resp.status != 200 else ""
    return resp.status, time.perf_counter() - started, kind


def _counters(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "fusionserve_inputs_total":
                out[f"inputs:{s.labels['task']}"] = s.value
            elif s.name == "fusionserve_dropped_requests_total":
                out[f"dropped:{s.labels['reason']}"] = s.value
            elif s.name.startswith("fusionserve_request_duration_seconds") and s.labels.get("status") == "504":
                out[f"504:{s.name.rsplit('_', 1)[1]}:{s.labels.get('le', '')}"] = s.value
    return out


def build_artifact(root: Path) -> Path:
    from benchmarks.models import build, minilm_folder
    from fusionserve.export.artifact import export_artifact

    out = root / "art"
    if not (out / "manifest.json").is_file():
        model = build(root / "model", minilm_folder(), n_adapters=4, n_tasks=2)
        export_artifact(model.spec, out, max_seq_len=128, progress=False)
    return out


def run(artifact: Path, port: int, burst: int, deadline_ms: int, busy_clients: int) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="fs-deadlines-"))
    server = start_fusionserve(artifact, port, "haproxy", logs, max_queued=burst + 2 * busy_clients + 16)
    stop = threading.Event()
    busy_answers: list[int] = []

    def busy() -> None:
        while not stop.is_set():
            busy_answers.append(_post(port, {"task": "task0", "inputs": [LONG] * 32})[0])

    try:
        for _ in range(2):  # warm-up: both tasks answer
            _post(port, {"task": "task0", "inputs": [LONG] * 32})
            _post(port, {"task": "task1", "inputs": ["warm up"]})
        threads = [threading.Thread(target=busy, daemon=True) for _ in range(busy_clients)]
        for t in threads:
            t.start()
        time.sleep(3.0)  # the busy clients have the model
        before = _counters(port)
        body = {"task": "task1", "inputs": ["a short text with a deadline"], "timeout_ms": deadline_ms}
        with ThreadPoolExecutor(burst) as pool:
            answers = list(pool.map(lambda _: _post(port, body), range(burst)))
        time.sleep(2.0)  # anything of the burst still queued would have run by now
        after = _counters(port)
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        server.stop()
    statuses: dict[str, int] = {}
    for status, _, kind in answers:
        key = f"{status} {kind}".strip()
        statuses[key] = statuses.get(key, 0) + 1
    late = sorted(s * 1000 for status, s, _ in answers if status == 504)
    ok = [s * 1000 for status, s, _ in answers if status == 200]
    ran = after.get("inputs:task1", 0) - before.get("inputs:task1", 0)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    n504 = delta("504:count:")
    # in the replica, from the request's arrival to its 504: the share answered within 0.1 s and 0.2 s, and the mean
    server_504 = {"mean_ms": delta("504:sum:") / n504 * 1000, "within_100ms": delta("504:bucket:0.1") / n504,
                  "within_200ms": delta("504:bucket:0.2") / n504} if n504 else None  # fmt: skip
    return {
        "burst": burst, "deadline_ms": deadline_ms, "busy_clients": busy_clients, "answers": statuses,
        "model_ran_of_burst": ran, "answered_200": len(ok),
        "dropped_deadline": after.get("dropped:deadline_exceeded", 0) - before.get("dropped:deadline_exceeded", 0),
        "504_in_replica": server_504,
        "504_ms_at_client": {"p50": statistics.median(late), "p99": late[int(0.99 * (len(late) - 1))], "max": late[-1]} if late else None,
        "200_ms_p50": statistics.median(ok) if ok else None,
        "busy_requests": len(busy_answers), "busy_non_200": sum(s != 200 for s in busy_answers),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path)
    p.add_argument("--burst", type=int, default=300)
    p.add_argument("--deadline-ms", type=int, default=50)
    p.add_argument("--busy-clients", type=int, default=4)
    p.add_argument("--port", type=int, default=8460)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/deadlines.json"))
    args = p.parse_args(argv)
    artifact = args.artifact or build_artifact(Path(tempfile.gettempdir()) / "fusionserve-bench-deadlines")
    result = run(artifact, args.port, args.burst, args.deadline_ms, args.busy_clients)
    print(json.dumps(result))
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
