"""Mixed-task batching: what a batch of rows of several tasks costs, in-process and over HTTP, in one run.

    python -m benchmarks.mixed [ARTIFACT] [--batch 16] [--seq 128] [--rounds 20] [--clients 16] [--seconds 10]
                               [--http-rounds 3] [--threads N]

ARTIFACT: a graph with at least 4 fusion tasks (default: MiniLM with 8 adapters and 4 fusions over them, built
and exported into ~/.cache/fusionserve/bench/minilm/n8-4tasks-art on first use, as benchmarks/latency.py does).

- In-process (``OnnxRunner.run_rows``, the replica's batch call): a batch of ``--batch`` rows of one task against
  the same rows spread evenly over 4 tasks, random token ids of ``--seq`` tokens, the two alternating round-robin
  (the median over rounds, and the median of per-round ratios). Whether the graph took the mixed batch in one pass
  (a task id per row) or one pass per task present is recorded. Then correctness on the same model: each row of the
  mixed batch against that row run alone for its task (max |diff| of the logits; target 1e-5).
- HTTP (``fusionserve serve``, haproxy ingress, one replica): ``--clients`` closed-loop clients all on one task
  against the same clients spreading their requests evenly over 4 tasks (one real sentence per request), runs
  alternating ``--http-rounds`` times against the same server; throughput, p50, the mean batch and the mean
  number of tasks per batch (from the server's own metrics).

Writes benchmarks/results/mixed.json and its section of benchmarks/RESULTS.md (the targets of the mixed-batching
issue: mixed <= 1.05x single in-process, >= 90% of single-task throughput over HTTP).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchmarks import servers
from benchmarks.httpload import closed_loop
from benchmarks.report import machine, write_section

if TYPE_CHECKING:
    from fusionserve.serving.model.runtime import OnnxRunner
    from fusionserve.serving.model.tokenize import Encoded

HERE = Path(__file__).parent
TASKS = 4


def default_artifact() -> Path:
    from benchmarks.latency import _artifact
    from benchmarks.models import build, minilm_folder

    work = Path.home() / ".cache" / "fusionserve" / "bench" / "minilm"
    out = work / "n8-4tasks-art"
    if not (out / "manifest.json").is_file():
        _artifact(build(work / "n8-4tasks", minilm_folder(), 8, n_tasks=TASKS), out)
    return out


def in_process(artifact: Path, tasks: list[str], batch: int, seq: int, rounds: int, threads: int | None) -> dict:
    from fusionserve.serving.model.runtime import OnnxRunner
    from fusionserve.serving.model.tokenize import Encoded

    runner = OnnxRunner(artifact, threads=threads, device="cpu")
    rng = np.random.default_rng(0)
    high = min(20000, runner.artifact.manifest["base_model"].get("vocab_size", 20000))  # a tiny test model's too
    ids = rng.integers(min(1000, high // 2), high, size=(batch, seq), dtype=np.int64)
    enc = Encoded(ids, np.ones_like(ids), np.zeros_like(ids), [False] * batch)
    variants = {"single": [tasks[0]] * batch, "mixed": [tasks[i % TASKS] for i in range(batch)]}
    for rows in variants.values():  # warm-up
        runner.run_rows(rows, enc, return_fusion_activations=True)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            t0 = time.perf_counter()
            runner.run_rows(variants[name], enc, return_fusion_activations=True)
            times[name].append((time.perf_counter() - t0) * 1000)
    single, mixed = statistics.median(times["single"]), statistics.median(times["mixed"])
    return {
        "batch": batch, "seq": seq, "rounds": rounds, "one_pass": runner.per_row_tasks,
        "single_ms": round(single, 2), "mixed_ms": round(mixed, 2), "ratio": round(mixed / single, 3),
        "ratio_per_round": round(statistics.median(m / s for s, m in zip(times["single"], times["mixed"], strict=True)), 3),
        "max_abs_diff_vs_alone": mixed_vs_alone(runner, variants["mixed"], enc),
    }  # fmt: skip


def mixed_vs_alone(runner: OnnxRunner, tasks: list[str], enc: Encoded) -> float:
    """Max |diff| of the logits between each row of the mixed batch and that row run alone for its task."""
    mixed = runner.run_rows(tasks, enc).logits
    alone = [runner.run(task, enc.rows([i])).logits[0] for i, task in enumerate(tasks)]
    return float(max(np.abs(m - a).max() for m, a in zip(mixed, alone, strict=True)))


def geometry(manifest: dict) -> str:
    """The model in a few words: backbone shape, adapters, tasks, precision."""
    base, tasks = manifest.get("base_model", {}), manifest["tasks"].values()
    fusions = sum(t["kind"] == "fusion" for t in tasks)
    return (
        f"{base.get('architecture', 'bert')}, {base.get('layers')} layers, hidden {base.get('hidden_size')}, "
        f"{base.get('attention_heads')} heads; {len(manifest['adapters'])} adapters, {fusions} fusion tasks of "
        f"{len(tasks)}; {manifest['precision']}"
    )


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(conn.getresponse().read().decode()):
        if fam.name in ("fusionserve_batch_size_inputs", "fusionserve_batch_tasks"):
            out |= {s.name: s.value for s in fam.samples if s.name.endswith(("_sum", "_count"))}
    return out


def _bodies(tasks: list[str], texts: list[str]):
    encoded = [json.dumps({"task": tasks[i % len(tasks)], "inputs": [t]}).encode() for i, t in enumerate(texts)]
    return lambda i: encoded[i % len(encoded)]


def over_http(args: argparse.Namespace, artifact: Path, tasks: list[str], texts: list[str]) -> dict:
    logs = Path(tempfile.mkdtemp(prefix="fusionserve-mixed-"))
    server = servers.start_fusionserve(artifact, args.port, "haproxy", logs, threads=args.threads)
    variants = {"one task": _bodies(tasks[:1], texts), f"{TASKS} tasks": _bodies(tasks, texts)}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    try:
        closed_loop(server.port, "/v1/classify", variants[f"{TASKS} tasks"], 4, 3.0)  # warm-up
        for r in range(args.http_rounds):
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                before = _scrape(server.port)
                row = closed_loop(server.port, "/v1/classify", variants[name], args.clients, args.seconds)
                after = _scrape(server.port)
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                batches = max(d.get("fusionserve_batch_size_inputs_count", 0.0), 1.0)
                row["mean_batch"] = round(d.get("fusionserve_batch_size_inputs_sum", 0.0) / batches, 2)
                row["mean_tasks_per_batch"] = round(d.get("fusionserve_batch_tasks_sum", 0.0) / batches, 2)
                runs[name].append(row)
                print(f"  http {name}: {row['throughput_rps']} req/s, mean batch {row['mean_batch']}", file=sys.stderr)
    finally:
        server.stop()
    out: dict = {"clients": args.clients, "seconds": args.seconds, "rounds": args.http_rounds, "runs": runs}
    rps = {k: statistics.median(r["throughput_rps"] for r in v) for k, v in runs.items()}
    out["throughput_ratio"] = round(rps[f"{TASKS} tasks"] / rps["one task"], 3)
    return out


def markdown(res: dict) -> str:
    m, ip, h = res["machine"], res["in_process"], res.get("http")
    lines = [
        f"Command: `{res['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; {m['python']}, onnxruntime {m['onnxruntime']}; {m['date']}. "
        f"Artifact `{res['artifact']}` ({res['model']}), tasks {', '.join(res['tasks'])}.",
        "",
        f"In-process, batch {ip['batch']} x {ip['seq']} tokens, {ip['rounds']} alternating rounds "
        f"({'one pass: a task id per row' if ip['one_pass'] else 'one pass per task present: the graph takes one task per call'}):",
        "",
        "| batch | median (ms) |",
        "|---|---:|",
        f"| one task | {ip['single_ms']} |",
        f"| {TASKS} tasks, evenly mixed | {ip['mixed_ms']} |",
        "",
        f"Mixed / single: {ip['ratio']} (median of per-round ratios {ip['ratio_per_round']}; target <= 1.05: "
        f"{'met' if ip['ratio_per_round'] <= 1.05 else 'NOT met'}).",
        "",
        f"Each row of the mixed batch against the same row run alone for its task: max |diff| of the logits "
        f"{ip['max_abs_diff_vs_alone']:.2g} (target <= 1e-5: {'met' if ip['max_abs_diff_vs_alone'] <= 1e-5 else 'NOT met'}).",
        "",
    ]
    if h is None:
        return "\n".join([*lines, "HTTP: not run (`--http-rounds 0`).", ""])
    lines += [
        f"HTTP, {h['clients']} closed-loop clients, {h['seconds']} s per run, {h['rounds']} alternating runs each:",
        "",
        "| clients' tasks | req/s (each run) | p50 ms (each run) | mean batch | tasks per batch |",
        "|---|---|---|---:|---:|",
    ]
    for name, rows in h["runs"].items():
        lines.append(
            f"| {name} | {', '.join(str(r['throughput_rps']) for r in rows)} | {', '.join(str(r['p50_ms']) for r in rows)} "
            f"| {statistics.median(r['mean_batch'] for r in rows)} | {statistics.median(r['mean_tasks_per_batch'] for r in rows)} |"
        )
    errors = sum(r["errors"] + r["lost"] for rows in h["runs"].values() for r in rows)
    lines += [
        "",
        f"Throughput over {TASKS} tasks / one task (medians): {h['throughput_ratio']} (target >= 0.90: "
        f"{'met' if h['throughput_ratio'] >= 0.9 else 'NOT met'}); errors + lost: {errors}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", help="artifact with >= 4 fusion tasks (default: built on first use)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=20, help="in-process alternating rounds")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0, help="per HTTP run")
    p.add_argument("--http-rounds", type=int, default=3, help="alternating HTTP runs per variant (0: in-process only)")
    p.add_argument("--threads", type=int, help="ONNX Runtime threads (default: every core)")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--texts", default="rotten_tomatoes")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.http_rounds < 0 or args.rounds < 1:
        p.error("--http-rounds must be >= 0 and --rounds >= 1")
    from benchmarks.load import load_texts
    from fusionserve.serving.model.artifact import load_artifact

    artifact = args.artifact or default_artifact()
    loaded = load_artifact(artifact)
    tasks = [n for n, t in loaded.tasks.items() if t.kind == "fusion"][:TASKS]
    if len(tasks) < TASKS:
        p.error(f"{artifact} has {len(tasks)} fusion task(s); this benchmark needs {TASKS}")
    res: dict = {
        "command": "python -m benchmarks.mixed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(), "artifact": str(artifact), "model": geometry(loaded.manifest), "tasks": tasks,
    }  # fmt: skip
    res["in_process"] = in_process(artifact, tasks, args.batch, args.seq, args.rounds, args.threads)
    print(f"mixed: in-process {res['in_process']}", file=sys.stderr)
    res["http"] = over_http(args, artifact, tasks, load_texts(args.texts)) if args.http_rounds else None
    text = markdown(res)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed.json").write_text(json.dumps(res, indent=2))
    if not args.no_record:
        write_section(HERE / "RESULTS.md", "mixed", f"Mixed-task batches ({res['model']})", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
