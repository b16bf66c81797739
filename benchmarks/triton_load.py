"""Closed-loop clients of Triton's own asyncio client (tritonclient.http.aio or tritonclient.grpc.aio), run in the
tritonclient environment (tests/triton_env.py), not fusionserve's; ``benchmarks/oip.py`` starts it and reads the one
JSON line it prints: the same summary as ``benchmarks.httpload`` (statuses, throughput, p50/p95/p99).

    .venv-triton/bin/python benchmarks/triton_load.py URL TASK TEXTS.json CLIENTS SECONDS http|grpc [BINARY: 1|0]
"""

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio


async def run(url, task, texts, clients, seconds, protocol, binary):
    module = httpaio if protocol == "http" else grpcaio
    client = module.InferenceServerClient(url, conn_limit=clients) if protocol == "http" else module.InferenceServerClient(url)
    latencies, statuses, sent = [], {}, 0
    stop_at = time.perf_counter() + seconds

    async def one(k):
        nonlocal sent
        i = k
        while time.perf_counter() < stop_at:
            tensor = module.InferInput("text", [1, 1], "BYTES")
            data = np.array([[texts[i % len(texts)]]], dtype=object)
            if protocol == "http":
                tensor.set_data_from_numpy(data, binary_data=binary)
                outputs = [module.InferRequestedOutput(n, binary_data=binary) for n in ("label", "scores")]
            else:
                tensor.set_data_from_numpy(data)
                outputs = [module.InferRequestedOutput(n) for n in ("label", "scores")]
            sent += 1
            started = time.perf_counter()
            try:
                await client.infer(task, [tensor], outputs=outputs)
                status = 200
            except Exception as exc:  # counted by its HTTP status (gRPC, and no answer: -1)
                code = str(getattr(exc, "status", lambda: None)() or "")
                status = int(code) if code.isdigit() else -1
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                latencies.append((time.perf_counter() - started) * 1000)
            i += clients

    began = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(clients)))
    elapsed = time.perf_counter() - began
    await client.close()
    pct = (lambda q: round(float(np.percentile(latencies, q)), 2)) if latencies else (lambda q: None)
    answered = sum(statuses.values())
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": answered, "lost": sent - answered,
            "errors": answered - statuses.get(200, 0), "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "throughput_rps": round(statuses.get(200, 0) / elapsed, 1), "p50_ms": pct(50), "p95_ms": pct(95),
            "p99_ms": pct(99)}  # fmt: skip


if __name__ == "__main__":
    url, task, texts_file, clients, seconds, protocol = sys.argv[1:7]
    binary = sys.argv[7] != "0" if len(sys.argv) > 7 else True
    texts = json.loads(Path(texts_file).read_text())
    print(json.dumps(asyncio.run(run(url, task, texts, int(clients), float(seconds), protocol, binary))))
