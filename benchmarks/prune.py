"""Pruning the default model: accuracy kept and latency saved, per target task, against the plain backbone.

    python -m benchmarks.prune [--targets amazon_food editorial_sentiment] [--keep-top 2] [--rounds 60] [--test-limit N]

For each target task: calibrate the fusion on the dev split (``fusionserve calibrate``), prune with the options
below (``fusionserve prune``, only the target served so that no other task keeps the dropped adapters in the
graph), evaluate every variant on the test split (``fusionserve evaluate``) and time one forward pass at batch 16,
seq 64 (the model's token limit) for all variants round-robin in one process (ONNX Runtime, CPU, 2 threads;
median over rounds):

- ``plain backbone``: the target's head-only task (frozen MiniLM + head): the floor
- ``fusion (unpruned)``: the fusion over the 5 source adapters and the target's own
- ``top K``: the K adapters with the highest mean weight over layers, in every layer
- ``top K per layer``: the K highest in each layer on its own
- ``top K, last layer dropped``: top K, and no fusion in the last layer (AdapterDrop)
- ``top K, all tasks served``: top K pruned in the full 11-task artifact, where the single-adapter tasks keep all
  adapters in the graph (what pruning saves when other tasks share the graph)

Writes benchmarks/results/prune.json, benchmarks/results/prune.png and the section in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from benchmarks.report import machine, record

HERE = Path(__file__).parent
THREADS = 2
SEQ = 64  # the default model's token limit (it is trained and served at 64 tokens)


def _data(target: str, folder: Path, test_limit: int | None = None) -> dict[str, Path]:
    from dataclasses import replace

    from fusionserve.training.datasets import write_jsonl
    from fusionserve.training.recipe import Recipe, sample, target_data

    recipe = Recipe()
    dataset = target_data(target, recipe)  # the test set the model's REPORT.md uses; --test-limit: a seeded sample
    dataset = replace(dataset, test=sample(dataset.test, test_limit or None, recipe.seed, f"prune/{target}"))
    paths = {}
    for split in ("dev", "test"):
        paths[split] = folder / f"{target}_{split}.jsonl"
        write_jsonl(dataset, split, paths[split])
    return paths


def _variants(target: str, keep: int) -> dict[str, dict[str, Any]]:
    """name -> how to build it: the tasks served, the pruning rule (None: export unpruned), the task timed."""
    from fusionserve.export.prune import PruneRule

    only = [target]
    return {
        "plain backbone": {"tasks": [f"{target}_head"], "rule": None, "task": f"{target}_head"},
        "fusion (unpruned)": {"tasks": only, "rule": None, "task": target},
        f"top {keep}": {"tasks": only, "rule": PruneRule(keep_top=keep), "task": target},
        f"top {keep} per layer": {"tasks": only, "rule": PruneRule(keep_top=keep, per_layer=True), "task": target},
        f"top {keep}, last layer dropped": {"tasks": only, "rule": PruneRule(keep_top=keep, drop_layers=(-1,)), "task": target},
        f"top {keep}, all tasks served": {"tasks": None, "rule": PruneRule(keep_top=keep), "task": target},
    }


def run_target(
    spec: Path, target: str, keep: int, rounds: int, work: Path, reuse: bool = False, test_limit: int | None = None
) -> dict[str, Any]:
    from fusionserve.export.artifact import export_artifact
    from fusionserve.export.prune import prune_artifact
    from fusionserve.scoring.calibrate import calibrate
    from fusionserve.scoring.evaluate import evaluate
    from fusionserve.scoring.inputs import read_labelled_jsonl
    from fusionserve.scoring.timing import latency_samples, paired_ratio
    from fusionserve.serving.model.activations import stats_document
    from fusionserve.serving.model.artifact import load_artifact
    from fusionserve.serving.model.runtime import OnnxRunner

    work.mkdir(parents=True, exist_ok=True)
    data = _data(target, work, test_limit)
    unpruned = work / "unpruned"
    if not reuse or not (unpruned / "manifest.json").is_file():
        export_artifact(spec, unpruned, max_seq_len=SEQ, tasks=[target], force=True)
    stats_path = work / "stats.json"
    stats, _ = calibrate(
        OnnxRunner(unpruned, THREADS, device="cpu"), [target], read_labelled_jsonl(data["dev"], False), progress=True
    )
    stats_path.write_text(json.dumps(stats_document(stats, str(unpruned), data["dev"], 0), indent=2))

    runners, kept = {}, {}
    for name, v in _variants(target, keep).items():
        folder = work / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        if v["rule"] is None:
            if name == "fusion (unpruned)":
                folder = unpruned
            elif not reuse or not (folder / "manifest.json").is_file():
                export_artifact(spec, folder, max_seq_len=SEQ, tasks=v["tasks"], force=True)
        elif reuse and (folder / "manifest.json").is_file():
            kept[name] = load_artifact(folder).manifest["pruning"]["tasks"][target]["kept_per_layer"]
        else:
            _, plans = prune_artifact(spec, stats_path, v["rule"], folder, v["tasks"], max_seq_len=SEQ, force=True)
            kept[name] = [list(layer) for layer in plans[target].kept_per_layer]
        runners[name] = OnnxRunner(folder, THREADS, device="cpu")

    rows: dict[str, dict[str, Any]] = {}
    for name, runner in runners.items():
        task = _variants(target, keep)[name]["task"]
        result = evaluate(runner, task, read_labelled_jsonl(data["test"], True), progress=True)
        manifest = runner.artifact.manifest
        rows[name] = {
            "task": task,
            "examples": result.examples,
            "accuracy": round(result.accuracy, 2),
            "ci95": [round(x, 2) for x in result.ci95],
            "adapters_per_layer": [len(stack) for stack in manifest["adapters_per_layer"]],
            "kept_per_layer": kept.get(name),
        }
    print(f"timing {len(runners)} variants of {target}: batch 16, seq {SEQ}, {rounds} rounds", file=sys.stderr)
    samples = latency_samples({n: (r, rows[n]["task"]) for n, r in runners.items()}, batch=16, seq=SEQ, rounds=rounds, warmup=5)
    for name, ms in samples.items():
        rows[name]["latency_ms"] = round(statistics.median(ms), 2)
        rows[name]["latency_ms_p25_p75"] = [round(float(np.percentile(ms, q)), 2) for q in (25, 75)]
        rows[name]["vs_plain"] = round(paired_ratio(samples, name, "plain backbone"), 3)
    base = rows["fusion (unpruned)"]["accuracy"]
    for row in rows.values():
        row["accuracy_vs_unpruned"] = round(row["accuracy"] / base, 4)
    return {
        "target": target,
        "test_examples": rows["fusion (unpruned)"]["examples"],
        "calibration": {"split": "dev", "tokens": stats[target]["tokens"], "mean_over_layers": stats[target]["mean_over_layers"]},
        "variants": rows,
    }


def markdown(results: list[dict[str, Any]], command: str, keep: int) -> str:
    m = machine()
    lines = [
        f"`{command}` on {m['cpu']} ({m['cores']} cores), onnxruntime {m['onnxruntime']}, {m['date']}. "
        "Default model (all-MiniLM-L6-v2; each target's fusion mixes 5 source adapters and its own). Calibrated on the "
        "dev split, accuracy on the test set of the model's REPORT.md (--test-limit: a seeded sample of it); "
        f"latency: one forward pass, batch 16, seq {SEQ}, fp32, ONNX Runtime CPU with 2 threads, median over rounds, "
        "every variant of a target timed round-robin in one process (shuffled order per round); 'vs plain' is the "
        "median over rounds of the variant's time over the plain backbone's in the same round. Targets: top "
        f"{keep} keeps >= 99% of the unpruned fusion's accuracy; costs <= 1.1x the plain backbone.",
        "",
    ]
    for r in results:
        means = sorted(r["calibration"]["mean_over_layers"].items(), key=lambda kv: -kv[1])
        lines += [
            f"### {r['target']} (test n={r['test_examples']})",
            "",
            "Mean fusion weight over layers (dev, "
            + f"{r['calibration']['tokens']:,} tokens): "
            + ", ".join(f"{a} {v:.3f}" for a, v in means),
            "",
            "| variant | adapters computed per layer | test accuracy % [95% CI] | vs unpruned | latency ms (p25-p75) | vs plain |",
            "|---|---|---|---|---|---|",
        ]
        for name, v in r["variants"].items():
            lines.append(
                f"| {name} | {' '.join(map(str, v['adapters_per_layer']))} | {v['accuracy']:.1f} "
                f"[{v['ci95'][0]:.1f}, {v['ci95'][1]:.1f}] | {100 * v['accuracy_vs_unpruned']:.1f}% | "
                f"{v['latency_ms']:.1f} ({v['latency_ms_p25_p75'][0]:.0f}-{v['latency_ms_p25_p75'][1]:.0f}) | {v['vs_plain']:.2f}x |"
            )
        kept = r["variants"].get(f"top {keep}", {}).get("kept_per_layer")
        if kept:
            lines += ["", f"top {keep} keeps: {', '.join(kept[0])}."]
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        for name, v in r["variants"].items():
            ax.errorbar(
                v["vs_plain"],
                v["accuracy"],
                yerr=[[v["accuracy"] - v["ci95"][0]], [v["ci95"][1] - v["accuracy"]]],
                fmt="o",
                capsize=3,
            )
            ax.annotate(name, (v["vs_plain"], v["accuracy"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.axvline(1.1, color="gray", linestyle=":", label="1.1x plain (target)")
        unpruned = r["variants"]["fusion (unpruned)"]["accuracy"]
        ax.axhline(0.99 * unpruned, color="red", linestyle=":", label="99% of unpruned (target)")
        ax.set_title(f"{r['target']}: test accuracy vs latency (batch 16, seq {SEQ})", fontsize=9)
        ax.set_xlabel("latency / plain backbone")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
    from fusionserve.training.recipe import TARGETS

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", type=Path, default=DEFAULT_MODEL / SPEC_FILE, help="model spec (default: the built-in model)")
    p.add_argument("--targets", nargs="+", default=list(TARGETS))
    p.add_argument("--keep-top", type=int, default=2)
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "prune")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    p.add_argument("--reuse", action="store_true", help="reuse the artifacts a previous run left in --workdir (same spec)")
    p.add_argument("--test-limit", type=int, help="evaluate on a seeded sample of at most this many test examples per target")
    args = p.parse_args(argv)
    command = "python -m benchmarks.prune " + " ".join(argv if argv is not None else sys.argv[1:])
    results = [
        run_target(args.spec, t, args.keep_top, args.rounds, args.workdir / t, args.reuse, args.test_limit) for t in args.targets
    ]
    data = {"command": command.strip(), "machine": machine(), "results": results}
    text = markdown(results, command.strip(), args.keep_top)
    record(args.out, "prune", "Pruning the default model", data, lambda path: plot(results, path), text, not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
