"""Heads beyond classification: what they cost the graph, in one run.

    python -m benchmarks.heads [--batch 16] [--seq 128] [--rounds 30] [--threads N] [--baseline main]

MiniLM (all-MiniLM-L6-v2: 6 layers, hidden 384) with N = 8 adapters (benchmarks/models.py), random token ids of
``--seq`` tokens, batches of ``--batch`` rows through ``OnnxRunner.run_rows`` (the replica's batch call), the variants of
each measure alternating round-robin in one process; medians, and the median of per-round ratios (what the targets use).

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


def timed(variants: dict[str, tuple[object, list[str]]], enc: object, rounds: int) -> dict[str, list[float]]:
    """Milliseconds per round of each variant (runner, each row's task), alternating their order every round."""
    for runner, tasks in variants.values():  # warm-up
        runner.run_rows(tasks, enc)  # type: ignore[attr-defined]
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runner, tasks = variants[name]
            t0 = time.perf_counter()
            runner.run_rows(tasks, enc)  # type: ignore[attr-defined]
            times[name].append((time.perf_counter() - t0) * 1000)
    return times


def ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    return round(statistics.median(n / d for n, d in zip(times[num], times[den], strict=True)), 3)


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
        "median_ms": {k: round(statistics.median(v), 2) for k, v in times.items()},
        "ratios": {
            "classification_only_vs_baseline_one_task": ratio(times, "this code, one task", "baseline, one task"),
            "classification_only_vs_baseline_mixed": ratio(times, "this code, 4 tasks mixed", "baseline, 4 tasks mixed"),
            "every_kind_vs_classification_rows": ratio(times, "five kinds: every kind mixed", "five kinds: classification rows"),
            "classification_rows_five_kinds_vs_classification_only": ratio(
                times, "five kinds: classification rows", "this code, one task"
            ),
            "every_kind_vs_classification_only_artifact": ratio(times, "five kinds: every kind mixed", "this code, one task"),
        },
    }  # fmt: skip


def markdown(res: dict) -> str:
    m, r, b = res["machine"], res["ratios"], res["baseline"]
    load_after = res.get("load_average_after", "?")
    lines = [
        f"Command: `{res['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, ISA flags {m['isa']}; {m['python']}, onnxruntime {m['onnxruntime']}; "
        f"{m['date']}; load average {m['load_average']} at the start, {load_after} at the end (other engineers' tests "
        "share the cores: compare the ratios, measured round-robin in one process).",
        "",
        f"MiniLM N = 8, batch {res['batch']} x {res['seq']} tokens, {res['rounds']} alternating rounds, `run_rows`:",
        "",
        "| graph, rows | median (ms) |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in res["median_ms"].items()),
        "",
        f"- Classification-only artifact, this code / `{b['ref']}` ({b['commit'][:10]}), same spec: "
        f"{r['classification_only_vs_baseline_one_task']} (one task), {r['classification_only_vs_baseline_mixed']} "
        f"(4 tasks mixed); target <= 1.03: "
        f"{'met' if max(r['classification_only_vs_baseline_one_task'], r['classification_only_vs_baseline_mixed']) <= 1.03 else 'NOT met'}. "
        f"The two graphs hold {'the same' if b['same_nodes'] else 'DIFFERENT'} nodes.",
        f"- Five-kind artifact, {res['batch']} rows cycling through every kind / {res['batch']} classification rows: "
        f"{r['every_kind_vs_classification_rows']}; target <= 1.1: "
        f"{'met' if r['every_kind_vs_classification_rows'] <= 1.1 else 'NOT met'}. Against the classification-only "
        f"artifact's one-task batch: {r['every_kind_vs_classification_only_artifact']}.",
        f"- Classification rows through the five-kind graph / through the classification-only graph: "
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
    p.add_argument("--threads", type=int, help="ONNX Runtime threads (default: every core)")
    p.add_argument("--baseline", default="main", help="git ref whose code exports the baseline graph (default main)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
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
