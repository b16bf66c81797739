"""Throughput of ``fusionserve score`` (local and ``--ray``) against the runtime in-process, in one run.

    python -m benchmarks.score [ARTIFACT] [--task T] [--rows 4000] [--batch-size 32] [--chunk-size 1024] [--rounds 3]

Real sentences (the Rotten Tomatoes test set, ``--texts``; repeated to ``--rows``) are written to a JSONL file and
scored, round-robin over ``--rounds`` rounds (each round runs every variant once, in a shuffled order, so machine
noise hits all of them alike; the median is reported), by:

- ``in-process, input order``: ``OnnxRunner.run`` on batches of ``--batch-size`` pre-encoded in input order —
  the runtime alone, no tokenizing, reading or writing
- ``in-process, length-sorted``: the same, with batches formed as ``score`` forms them (sorted by token length
  within chunks of ``--chunk-size``): the runtime's share of what ``score`` does
- ``score``: ``score_file`` (what ``fusionserve score`` runs) from JSONL to JSONL, rows per second of its scoring
  loop (reading, tokenizing twice — to sort, then to encode —, running, writing, fsync per chunk); the model load
  and the input's sha256 are timed apart
- ``score --ray``: the same on Ray Data on a local Ray started once beforehand (its start-up is timed apart; actor
  start-up, each loading the model, is inside the figure)

ARTIFACT defaults to the built-in model (``cli.default.ensure_artifact()``). Threads: the in-process runs and
``score`` use every core of this process; ``--ray`` runs one actor per core with one thread each.

Writes benchmarks/results/score.json and the section in benchmarks/RESULTS.md (unless ``--no-record``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.load import load_texts
from benchmarks.report import RESULTS, machine, write_section
from benchmarks.servers import artifact_and_task

HERE = Path(__file__).parent
VARIANTS = ("in-process, input order", "in-process, length-sorted", "score", "score --ray")
TARGET = 0.9  # score within 10% of in-process


def _in_process(runner, task: str, texts: list[str], batch_size: int, chunk_size: int | None) -> Callable[[], float]:
    """A timed pass over pre-encoded batches: input order (``chunk_size`` None) or length-sorted within chunks."""
    from fusionserve.serving.model.predictions import TextInput

    inputs = [TextInput(t) for t in texts]
    order = list(range(len(inputs)))
    if chunk_size is not None:
        lengths = runner.encoder.count_tokens(inputs)
        order = [i for c in range(0, len(order), chunk_size) for i in sorted(order[c : c + chunk_size], key=lengths.__getitem__)]
    batches = []
    for c in range(0, len(order), chunk_size or len(order)):
        chunk = order[c : c + (chunk_size or len(order))]
        batches += [
            runner.encoder.encode([inputs[i] for i in chunk[b : b + batch_size]]) for b in range(0, len(chunk), batch_size)
        ]

    def run() -> float:
        t0 = time.perf_counter()
        for enc in batches:
            runner.run(task, enc)
        return len(texts) / (time.perf_counter() - t0)

    return run


def _score(artifact: Path, task: str, src: Path, out: Path, batch_size: int, chunk_size: int, ray: bool) -> Callable[[], float]:
    from fusionserve.scoring.config import ScoreConfig
    from fusionserve.scoring.score import score_file

    cfg = ScoreConfig(
        artifact, task, src, out, batch_size=batch_size, chunk_size=chunk_size, overwrite=True, progress=False, ray=ray
    )

    def run() -> float:
        summary = score_file(cfg)
        if summary.failed or not summary.complete:
            raise RuntimeError(f"score did not score every row: {summary.render()}")
        return summary.rows / summary.seconds

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path, nargs="?", help="artifact folder (default: the built-in model)")
    p.add_argument("--task", help="task to score (default: the first fusion task)")
    p.add_argument("--rows", type=int, default=4000, help="rows scored per variant and round")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--texts", default="rotten_tomatoes", help="dataset whose test texts are scored")
    p.add_argument("--no-ray", action="store_true", help="leave out the --ray variant")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="print only: write neither results/score.json nor RESULTS.md")
    args = p.parse_args(argv)
    command = "python -m benchmarks.score " + " ".join(argv if argv is not None else sys.argv[1:])

    from fusionserve.serving.model.artifact import sha256
    from fusionserve.serving.model.runtime import OnnxRunner

    _, task, art = artifact_and_task(args.artifact, args.task)
    pool = load_texts(args.texts)
    texts = [pool[i % len(pool)] for i in range(args.rows)]
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="fusionserve-bench-score-"))
    src = work / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    print(f"score: {len(texts)} rows of {args.texts} ({len(set(texts))} distinct), task {task}, {cores} cores", file=sys.stderr)

    t0 = time.perf_counter()
    runner = OnnxRunner(art, threads=cores, device="cpu")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sha256(src)
    hash_s = time.perf_counter() - t0
    runs: dict[str, Callable[[], float]] = {
        VARIANTS[0]: _in_process(runner, task, texts, args.batch_size, None),
        VARIANTS[1]: _in_process(runner, task, texts, args.batch_size, args.chunk_size),
        VARIANTS[2]: _score(art.folder, task, src, work / "out.jsonl", args.batch_size, args.chunk_size, False),
    }
    ray_start_s = None
    if not args.no_ray:
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
        ray_start_s = time.perf_counter() - t0
        runs[VARIANTS[3]] = _score(art.folder, task, src, work / "out-ray.jsonl", args.batch_size, args.chunk_size, True)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    rng = random.Random(0)
    try:
        runs[VARIANTS[0]]()  # warm-up: the first runs of a session allocate
        for r in range(args.rounds):
            names = list(runs)
            rng.shuffle(names)
            for name in names:
                rates[name].append(runs[name]())
                print(f"  round {r + 1}: {name}: {rates[name][-1]:.1f} rows/s", file=sys.stderr)
    finally:
        if ray_start_s is not None:
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": command,
        "machine": machine(),
        "artifact": str(art.folder),
        "task": task,
        "rows": len(texts),
        "texts": args.texts,
        "batch_size": args.batch_size,
        "chunk_size": args.chunk_size,
        "rounds": args.rounds,
        "rows_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "median_rows_per_s": {k: round(statistics.median(vs), 1) for k, vs in rates.items()},
        "model_load_s": round(load_s, 2),
        "input_sha256_s": round(hash_s, 3),
        "ray_start_s": None if ray_start_s is None else round(ray_start_s, 1),
    }
    text = markdown(result)
    print(text)
    if not args.no_record:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "score.json").write_text(json.dumps(result, indent=2) + "\n")
        write_section(RESULTS, "score", "Batch scoring (fusionserve score)", text)
    return 0


def markdown(r: dict) -> str:
    m, med = r["machine"], r["median_rows_per_s"]
    base, sorted_base = med[VARIANTS[0]], med[VARIANTS[1]]
    lines = [
        f"Command: `{r['command'].strip()}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; {m['python']}, onnxruntime {m['onnxruntime']}; {m['date']}. Task "
        f"`{r['task']}` of `{r['artifact']}`, {r['rows']} {r['texts']} sentences JSONL -> JSONL, batch {r['batch_size']}, "
        f"chunk {r['chunk_size']}, median of {r['rounds']} rounds.",
        "",
        "| variant | rows/s (median) | rounds | vs in-process, input order | vs in-process, length-sorted |",
        "|---|---:|---|---:|---:|",
    ]
    for name, v in med.items():
        each = ", ".join(f"{x:.1f}" for x in r["rows_per_s"][name])
        lines.append(f"| {name} | {v:.1f} | {each} | {v / base:.2f}x | {v / sorted_base:.2f}x |")
    score = med[VARIANTS[2]]
    lines += [
        "",
        f"Target: `score` within 10% of in-process: {score / base:.2f}x of input-order batches, {score / sorted_base:.2f}x of "
        f"the same length-sorted batches — {'met' if score >= TARGET * base else 'NOT met'} (input order), "
        f"{'met' if score >= TARGET * sorted_base else 'NOT met'} (length-sorted).",
        f"Outside the figures: model load {r['model_load_s']} s, the input's sha256 {r['input_sha256_s']} s"
        + (f", Ray start-up {r['ray_start_s']} s." if r["ray_start_s"] is not None else "."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
