"""What each protocol costs in the replica outside the model: one classify call's own work for HTTP and for gRPC, in
process, without Ray or a network, with the model replaced by a fixed answer (so only the parse, validation, answer
and encoding steps are timed).

- HTTP: the request body's bytes -> ``parse_json`` -> ``Classifier`` -> the answer dict -> ``orjson.dumps``.
- gRPC: the request message's bytes -> ``ClassifyRequest.FromString`` (Serve's gRPC server does this) ->
  ``classify_grpc`` -> ``SerializeToString`` (Serve again).

    python -m benchmarks.protocol_cost ART [--task T] [--inputs 1 8] [--calls 2000] [--rounds 30] [--profile]
    python -m benchmarks.protocol_cost --key-check [--calls 20000] [--rounds 30]

``--key-check`` times the API key check every request pays when the server has a key (serving/api/auth.py): the
``authorization`` header found among a browser-sized header list, hashed and compared with every accepted key, for a
right key, a wrong key of the same length and of another length, no header, and 1 or 3 accepted keys (rotation).

Prints microseconds per call for each protocol and input count: the fastest round (timeit's estimate on a busy
machine: other work only ever adds time) and the median round, the protocols alternating round by round;
``--profile`` adds the top of a cProfile of each path. Needs no Ray; the figures go into benchmarks/RESULTS.md by hand with the command and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import orjson

from fusionserve.serving.api import fusionserve_pb2 as pb
from fusionserve.serving.api.auth import KeyCheck, header
from fusionserve.serving.api.classify import Classifier, parse_json
from fusionserve.serving.api.grpc_ingress import classify_grpc
from fusionserve.serving.api.metrics import Metrics
from fusionserve.serving.api.schemas import ClassifyRequest, HTTPError, Limits
from fusionserve.serving.model.artifact import Artifact, load_artifact
from fusionserve.serving.model.heads import Unit
from fusionserve.serving.model.runtime import Served
from fusionserve.serving.model.tokenize import Encoder
from fusionserve.serving.scheduler.results import JobResult, TaskResult

TEXT = "the plot is thin but the actors carry it well enough to keep you watching"


class FixedScheduler:
    """Stands in for the batching scheduler: answers every request with the same logits at once."""

    def __init__(self, artifact: Artifact, num_labels: int) -> None:
        self.logits = np.linspace(-1.0, 1.0, num_labels, dtype=np.float32)
        self.runner = SimpleNamespace(served=Served(artifact, {}), artifact=artifact)  # what the classifier reads

    def check_room(self) -> None:
        return None

    async def submit(self, tasks: list[str], inputs: tuple, **_: object) -> JobResult:
        n = len(inputs)
        units = [Unit((), False)] * n  # classification: one row per input, nothing more to read
        results = {t: TaskResult([[self.logits]] * n, None, [False] * n, units) for t in tasks}
        return JobResult(results, [False] * n, 0.0, 1)


def paths(art: str, task: str | None, n: int) -> tuple[dict[str, Callable[[], object]], str]:
    """One coroutine factory per protocol for a request of ``n`` copies of TEXT."""
    artifact = load_artifact(art)
    task = task or next(iter(artifact.tasks))
    encoder = Encoder.from_file(artifact.tokenizer_path, artifact.max_seq_len, artifact.pad_token)  # checks options only
    core = Classifier(encoder, FixedScheduler(artifact, len(artifact.tasks[task].labels)), Limits(), Metrics())  # type: ignore[arg-type]
    body = orjson.dumps({"task": task, "inputs": [TEXT] * n})
    wire = pb.ClassifyRequest(task=task, inputs=[pb.Input(text=TEXT)] * n).SerializeToString()
    where = {"replica": "r", "node": "n"}

    async def http() -> bytes:
        async def read() -> ClassifyRequest:  # the replica's _read, with the body already received
            return parse_json(body)

        outcome = await core(read, "POST /v1/classify")
        if isinstance(outcome, HTTPError):
            raise outcome
        return orjson.dumps(outcome)

    async def grpc() -> bytes:
        msg = pb.ClassifyRequest.FromString(wire)
        return (await classify_grpc(core, msg, None, where)).SerializeToString()

    return {"http": http, "grpc": grpc}, task


async def _repeat(make: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await make()  # type: ignore[misc]
    return (time.perf_counter() - started) / calls * 1e6


def measure(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) over ``rounds`` of microseconds per call, the protocols alternating round by round."""
    per: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            per[name].append(asyncio.run(_repeat(fns[name], calls)))
    return {k: (min(v), statistics.median(v)) for k, v in per.items()}


def profile(fn: Callable[[], object], calls: int, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(_repeat(fn, calls))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def key_checks(calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) microseconds per check over ``rounds`` of ``calls``, for each case (see the docstring)."""
    key = "k" * 43  # the length of a 32-byte key in URL-safe base64
    headers = [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"python-requests/2.32.3"), (b"accept-encoding", b"gzip"),
               (b"accept", b"*/*"), (b"connection", b"keep-alive"), (b"content-type", b"application/json"),
               (b"content-length", b"64")]  # fmt: skip
    cases = {
        "right key, 1 key": (KeyCheck([key]), f"Bearer {key}"),
        "wrong key, same length": (KeyCheck([key]), "Bearer " + "x" * len(key)),
        "wrong key, other length": (KeyCheck([key]), "Bearer short"),
        "no header": (KeyCheck([key]), None),
        "right key, 3 keys": (KeyCheck(["a" * 43, "b" * 43, key]), f"Bearer {key}"),
    }
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (check, value) in cases.items():
            scope = headers + ([(b"authorization", value.encode())] if value is not None else [])
            started = time.perf_counter()
            for _ in range(calls):
                check.allows(header(scope))
            out[name].append((time.perf_counter() - started) / calls * 1e6)
    return {k: (min(v), statistics.median(v)) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", nargs="?")
    p.add_argument("--key-check", action="store_true", help="time the API key check instead (needs no artifact)")
    p.add_argument("--task", default=None)
    p.add_argument("--inputs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    if args.key_check:
        for name, (fast, med) in key_checks(args.calls * 10, args.rounds).items():
            print(f"key check, {name}: {fast:.2f} us fastest round ({med:.2f} median)")
        return
    if args.artifact is None:
        p.error("give an artifact (or --key-check)")
    for n in args.inputs:
        fns, task = paths(args.artifact, args.task, n)
        for fn in fns.values():  # same answer check and warm-up before timing
            asyncio.run(_repeat(fn, 200))
        (h, h_med), (g, g_med) = measure(fns, args.calls, args.rounds).values()
        print(f"task {task}, {n} input(s), us/call fastest (median) round: HTTP {h:.1f} ({h_med:.1f}), "
              f"gRPC {g:.1f} ({g_med:.1f}); gRPC - HTTP {g - h:+.1f} ({g_med - h_med:+.1f})")  # fmt: skip
        if args.profile:
            for name, fn in fns.items():
                print(f"--- {name}, {n} input(s)\n{profile(fn, args.calls)}")


if __name__ == "__main__":
    main()
