"""Heads beyond classification: what they cost the graph, in one run.

    python -m benchmarks.heads [--batch 16] [--seq 128] [--rounds 30] [--threads 1] [--baseline main]

MiniLM (all-MiniLM-L6-v2: 6 layers, hidden 384) with N = 8 adapters (benchmarks/models.py), random token ids of
``--seq`` tokens, batches of ``--batch`` rows through ``OnnxRunner.run_rows`` (the replica's batch call), the variants of
each measure alternating round-robin in one process; medians, and the median of per-round ratios (what the targets use).
By default ONNX Runtime runs one thread and the targets are read on that thread's CPU time, which a loaded machine does
not inflate (``timed``); wall-clock figures are recorded beside (``--threads 0``: every core, targets on wall clock).

1. Today's cost of a classification-only artifact: the 4-fusion-task model of benchmarks/mixed.py exported by this code
   and by the code of git ``--baseline`` (main: before heads beyond classification; a git archive of it imported in a
   subprocess), the same spec; a batch of one task, and a batch mixing the 4 tasks per row, through each graph. Also
   whether the two graphs hold the same nodes. Target: this code's graph <= 1.03x the baseline's.
2. A batch mixing every head kind: an artifact of five tasks, one per kind (classification with 3 labels, regression,
   multiple choice, tagging with 9 labels, extractive QA), each a fusion over the 8 adapters; ``--batch`` rows of the
   classification task against ``--batch`` rows cycling through the five kinds (both outputs read). Target: mixed <=
   1.1x classification-only. Beside it, for the docs: the same classification rows through the classification-only
   artifact of measure 1 (what a graph with token-level heads costs rows that do not read them).

Writes benchmarks/results/heads.json and its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.report import machine, write_section

HERE = Path(__file__).parent
WORK = Path.home() / ".cache" / "fusionserve" / "bench" / "heads"  # the specs; the baseline's export, by its commit
TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
KINDS = [  # task i's head: (kind, the adapters library's method adding it, its arguments)
    ("classification", "add_classification_head", {"num_labels": 3}),
    ("regression", "add_classification_head", {"num_labels": 1}),
    ("multiple_choice", "add_multiple_choice_head", {"num_choices": 4}),
    ("tagging", "add_tagging_head", {"num_labels": len(TAGS), "id2label": dict(enumerate(TAGS))}),
    ("question_answering", "add_qa_head", {}),
]


def models() -> tuple[Path, Path]:
    """The specs (built by the adapters library on first use): 4 classification fusion tasks (benchmarks/mixed.py's
    model), and one fusion task per head kind (KINDS); MiniLM, N = 8."""
    from benchmarks.models import build, minilm_folder

    four, five = WORK / "n8-4tasks" / "model.yaml", WORK / "n8-5kinds" / "model.yaml"
    if not four.is_file():
        build(four.parent, minilm_folder(), 8, n_tasks=4)
    if not five.is_file():
        build(five.parent, minilm_folder(), 8, n_tasks=len(KINDS), heads=[k[1:] for k in KINDS])
    return four, five


def export(spec: Path, out: Path) -> Path:
    """``spec`` exported by this code (fp32, 128 tokens), into a fresh folder each run."""
    from fusionserve.export.artifact import export_artifact

    export_artifact(spec, out, max_seq_len=128, progress=False)
    return out


def baseline_artifact(ref: str, spec: Path, out: Path) -> str:
    """Export ``spec`` into ``out`` with the fusionserve code of git ``ref`` (an archive of it, imported in a subprocess
    that does not see this checkout); returns the commit."""
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", ref], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    stamp = out.with_name(out.name + ".commit")  # which code exported ``out``
    if (out / "manifest.json").is_file() and stamp.is_file() and stamp.read_text() == commit:
        return commit
    tmp = Path(tempfile.mkdtemp(prefix="fusionserve-baseline-"))
    src, root = tmp / "src", tmp / "root"
    src.mkdir()
    archive = subprocess.run(["git", "archive", commit], cwd=repo, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    (root / "fusionserve").parent.mkdir()
    (src / "fusionserve").rename(root / "fusionserve")  # the package's layout: see pyproject.toml's package-dir
    for part in ("cli", "export", "serving", "scoring", "training"):
        (root / "fusionserve" / part).symlink_to(src / part)
    code = (
        "from fusionserve.export.artifact import export_artifact; "
        f"export_artifact({str(spec)!r}, {str(out)!r}, max_seq_len=128, force=True, progress=False)"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, check=True)  # cwd: not this checkout's package
    stamp.write_text(commit)
    return commit


def same_nodes(a: Path, b: Path) -> bool:
    """Whether two graphs hold the same nodes (operator and attributes, constants' values included; the order of
    independent nodes may differ) and initializers of the same shapes."""
    from collections import Counter

    import onnx

    ga, gb = (onnx.load(str(p / "model.onnx"), load_external_data=False).graph for p in (a, b))

    def nodes(g: onnx.GraphProto) -> Counter:
        return Counter((n.op_type, tuple(x.SerializeToString() for x in n.attribute)) for n in g.node)

    return nodes(ga) == nodes(gb) and sorted(tuple(i.dims) for i in ga.initializer) == sorted(
        tuple(i.dims) for i in gb.initializer
    )


def timed(variants: dict[str, tuple[object, list[str]]], enc: object, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per variant (runner, each row's task) and clock, the milliseconds of each round, the variants' order alternating
    every round. Clocks: "wall", and "cpu", the calling thread's CPU time (``time.thread_time``): with one ONNX Runtime
    thread the whole run is on that thread, so "cpu" is what the work costs, whatever else the machine runs."""
    for runner, tasks in variants.values():  # warm-up
        runner.run_rows(tasks, enc)  # type: ignore[attr-defined]
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runner, tasks = variants[name]
            c0, t0 = time.thread_time(), time.perf_counter()
            runner.run_rows(tasks, enc)  # type: ignore[attr-defined]
            times[name]["wall"].append((time.perf_counter() - t0) * 1000)
            times[name]["cpu"].append((time.thread_time() - c0) * 1000)
    return times


def ratio(times: dict[str, dict[str, list[float]]], num: str, den: str, clock: str) -> float:
    """The median over rounds of ``num``'s time / ``den``'s time on ``clock``."""
    return round(statistics.median(n / d for n, d in zip(times[num][clock], times[den][clock], strict=True)), 3)


RATIOS = {  # name -> (numerator, denominator)
    "classification_only_vs_baseline_one_task": ("this code, one task", "baseline, one task"),
    "classification_only_vs_baseline_mixed": ("this code, 4 tasks mixed", "baseline, 4 tasks mixed"),
    "every_kind_vs_classification_rows": ("five kinds: every kind mixed", "five kinds: classification rows"),
    "classification_rows_five_kinds_vs_classification_only": ("five kinds: classification rows", "this code, one task"),
    "every_kind_vs_classification_only_artifact": ("five kinds: every kind mixed", "this code, one task"),
}


def measure(args: argparse.Namespace) -> dict:
    from fusionserve.serving.model.runtime import OnnxRunner
    from fusionserve.serving.model.tokenize import Encoded

    spec, spec_kinds = models()
    fresh = Path(tempfile.mkdtemp(prefix="fusionserve-heads-bench-"))
    ours, kinds = export(spec, fresh / "four"), export(spec_kinds, fresh / "kinds")
    commit = baseline_artifact(args.baseline, spec, WORK / "n8-4tasks-baseline")
    before = WORK / "n8-4tasks-baseline"
    runners = {p: OnnxRunner(p, threads=args.threads, device="cpu") for p in (ours, before, kinds)}
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, size=(args.batch, args.seq), dtype=np.int64)
    enc = Encoded(ids, np.ones_like(ids), np.zeros_like(ids), [False] * args.batch)
    four = list(runners[ours].artifact.tasks)
    five = list(runners[kinds].artifact.tasks)
    variants = {
        "baseline, one task": (runners[before], [four[0]] * args.batch),
        "this code, one task": (runners[ours], [four[0]] * args.batch),
        "baseline, 4 tasks mixed": (runners[before], [four[i % 4] for i in range(args.batch)]),
        "this code, 4 tasks mixed": (runners[ours], [four[i % 4] for i in range(args.batch)]),
        "five kinds: classification rows": (runners[kinds], [five[0]] * args.batch),
        "five kinds: every kind mixed": (runners[kinds], [five[i % 5] for i in range(args.batch)]),
    }
    times = timed(variants, enc, args.rounds)
    return {
        "baseline": {"ref": args.baseline, "commit": commit, "same_nodes": same_nodes(ours, before)},
        "artifacts": {"classification_only": str(ours), "baseline": str(before), "five_kinds": str(kinds)},
        "tasks": {"five_kinds": {t: runners[kinds].artifact.tasks[t].head for t in five}},
        "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
        "threads": args.threads,
        "median_ms": {k: {c: round(statistics.median(v), 2) for c, v in t.items()} for k, t in times.items()},
        "ratios": {c: {name: ratio(times, *pair, c) for name, pair in RATIOS.items()} for c in ("wall", "cpu")},
    }  # fmt: skip


def markdown(res: dict) -> str:
    m, b = res["machine"], res["baseline"]
    clock = "cpu" if res["threads"] == 1 else "wall"  # what the targets are read on: see ``timed``
    r = res["ratios"][clock]
    cls = max(r["classification_only_vs_baseline_one_task"], r["classification_only_vs_baseline_mixed"])
    lines = [
        f"Command: `{res['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, ISA flags {m['isa']}; {m['python']}, onnxruntime {m['onnxruntime']}; "
        f"{m['date']}; load average {m['load_average']} at the start, {res['load_average_after']} at the end (other "
        "engineers' tests share the cores). Variants alternate round-robin in one process; ratios are medians of per-round "
        + (
            "ratios of the calling thread's CPU time (one ONNX Runtime thread: the whole run is on that thread, so the "
            "figure is what the work costs, free of the other processes' scheduling); wall-clock ratios beside."
            if clock == "cpu"
            else "wall-clock ratios."
        ),
        "",
        f"MiniLM N = 8, batch {res['batch']} x {res['seq']} tokens, {res['rounds']} alternating rounds, `run_rows`, "
        f"ONNX Runtime threads: {res['threads'] or 'every core'}:",
        "",
        "| graph, rows | median CPU ms (calling thread) | median wall ms |",
        "|---|---:|---:|",
        *(f"| {k} | {v['cpu']} | {v['wall']} |" for k, v in res["median_ms"].items()),
        "",
        "| ratio (median of per-round ratios) | CPU time | wall clock |",
        "|---|---:|---:|",
        *(f"| {k} | {res['ratios']['cpu'][k]} | {res['ratios']['wall'][k]} |" for k in RATIOS),
        "",
        f"- Classification-only artifact, this code / `{b['ref']}` ({b['commit'][:10]}), same spec ({clock}): "
        f"{r['classification_only_vs_baseline_one_task']} (one task), {r['classification_only_vs_baseline_mixed']} "
        f"(4 tasks mixed); target <= 1.03: {'met' if cls <= 1.03 else 'NOT met'}. The two graphs hold "
        f"{'the same nodes (operators, attributes, constants; initializer shapes)' if b['same_nodes'] else 'DIFFERENT nodes'}.",
        f"- Five-kind artifact, {res['batch']} rows cycling through every kind / {res['batch']} classification rows "
        f"({clock}): {r['every_kind_vs_classification_rows']}; target <= 1.1: "
        f"{'met' if r['every_kind_vs_classification_rows'] <= 1.1 else 'NOT met'}. Against the classification-only "
        f"artifact's one-task batch: {r['every_kind_vs_classification_only_artifact']}.",
        f"- Classification rows through the five-kind graph / through the classification-only graph ({clock}): "
        f"{r['classification_rows_five_kinds_vs_classification_only']} (a batch without token-level rows does not ask "
        "for `token_logits`).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument(
        "--threads", type=int, default=1, help="ONNX Runtime threads (default 1: the targets are read on CPU time; 0: every core)"
    )
    p.add_argument("--baseline", default="main", help="git ref whose code exports the baseline graph (default main)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.threads = args.threads or None  # 0: ONNX Runtime's default, every core
    res: dict = {"command": "python -m benchmarks.heads " + " ".join(argv if argv is not None else sys.argv[1:])}
    res["machine"] = machine()
    res |= measure(args)
    res["load_average_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = markdown(res)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heads.json").write_text(json.dumps(res, indent=2))
    if not args.no_record:
        write_section(HERE / "RESULTS.md", "heads", "Heads beyond classification: cost of the graph (MiniLM, N = 8)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
