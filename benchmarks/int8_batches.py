"""int8 on the default model: how much a row's answer depends on the rows batched with it.

    python -m benchmarks.int8_batches [--rows 32] [--batch 16] [--workdir DIR] [--no-record]

Dynamic quantization computes each activation tensor's uint8 scale at run time from the whole batch, padding
included, so the same text can get a different answer beside other texts. Here every served task's dev split gives
--rows texts (a seeded sample; every task of the default model, 11), each run for its own task:

- ``alone``: a batch of one, no padding (the reference of each precision)
- ``one task, length-sorted batches``: per task, rows sorted by token length and cut into batches of --batch, as
  ``fusionserve score`` forms them (little padding)
- ``one task, shuffled batches``: per task, rows in a seeded random order, batches of --batch (padding to the longest)
- ``mixed tasks, shuffled batches``: every row in a seeded random order, batches of --batch whose rows are classified
  each for its own task in one forward pass (``OnnxRunner.run_rows``, the graph takes a task id per row), as the
  server's batcher mixes them

Per arrangement and precision: the share of rows whose label is the one they get alone, and the largest and the 99th
percentile of a row's largest probability change against alone; fp32 shows what batching changes without
quantization. The int8 artifact is the shipped options' copy of the fp32 one (``models.int8_copy``); both are reused
from --workdir when there. Labels and probabilities do not depend on the machine's load (no speed is measured).
Writes benchmarks/results/int8_batches.json and .png, and its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from benchmarks.report import machine, record

HERE = Path(__file__).parent
THREADS = 2
ARRANGEMENTS = ("one task, length-sorted batches", "one task, shuffled batches", "mixed tasks, shuffled batches")


def artifacts(work: Path) -> dict[str, Path]:
    """The default model's fp32 artifact at 128 tokens (parity grid 'quick') and its int8 copy, under ``work``."""
    from benchmarks.models import int8_copy
    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE
    from fusionserve.export.artifact import export_artifact

    spec, fp32 = DEFAULT_MODEL / SPEC_FILE, work / "fp32"
    if not (fp32 / "manifest.json").is_file():
        export_artifact(spec, fp32, "fp32", 128, force=True, parity_grid="quick")
    return {"fp32": fp32, "int8": int8_copy(fp32, work / "int8", spec)}


def sample(tasks: list[str], work: Path, per_task: int) -> list[tuple[str, dict[str, Any]]]:
    """(task, dev row) for ``per_task`` seeded dev rows of each task's dataset."""
    from benchmarks.int8 import _split

    out = []
    for task in tasks:
        dataset = task.removesuffix("_adapter").removesuffix("_head")
        out += [(task, row) for row in _split(dataset, "dev", work, per_task)]
    return out


def batches(rows: list[tuple[str, dict[str, Any]]], lengths: np.ndarray, size: int) -> dict[str, list[list[int]]]:
    """Arrangement -> its batches of row indices (see the module docstring)."""
    rng = np.random.default_rng(0)
    by_task: dict[str, list[int]] = {}
    for i, (task, _) in enumerate(rows):
        by_task.setdefault(task, []).append(i)

    def cut(order: list[int]) -> list[list[int]]:
        return [order[k : k + size] for k in range(0, len(order), size)]

    out: dict[str, list[list[int]]] = {"alone": [[i] for i in range(len(rows))]}
    out[ARRANGEMENTS[0]] = [b for idx in by_task.values() for b in cut(sorted(idx, key=lengths.__getitem__))]
    out[ARRANGEMENTS[1]] = [b for idx in by_task.values() for b in cut([idx[k] for k in rng.permutation(len(idx))])]
    out[ARRANGEMENTS[2]] = cut([int(i) for i in rng.permutation(len(rows))])
    return out


def _probabilities(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def run_arrangements(runner: Any, rows: list[tuple[str, dict[str, Any]]], size: int) -> dict[str, list[np.ndarray]]:
    """Arrangement -> per row (input order), its probabilities over its task's labels."""
    from fusionserve.serving.model.predictions import TextInput

    tasks = [task for task, _ in rows]
    enc = runner.encoder.encode([TextInput(r["text"], r.get("text_pair")) for _, r in rows])
    out: dict[str, list[np.ndarray]] = {}
    for name, groups in batches(rows, enc.attention_mask.sum(1), size).items():
        probs: list[np.ndarray | None] = [None] * len(rows)
        for idx in groups:
            for i, logits in zip(idx, runner.run_rows([tasks[i] for i in idx], enc.rows(idx)).logits, strict=True):
                probs[i] = _probabilities(logits)
        out[name] = [p for p in probs if p is not None]
        print(f"  {name}: {len(groups)} batches", file=sys.stderr)
    return out


def against(reference: list[np.ndarray], other: list[np.ndarray]) -> dict[str, Any]:
    """Label agreement of ``other`` with ``reference`` and each row's largest probability change, summarized."""
    same = [int(a.argmax() == b.argmax()) for a, b in zip(reference, other, strict=True)]
    change = np.array([float(np.abs(a - b).max()) for a, b in zip(reference, other, strict=True)])
    return {
        "rows": len(same),
        "agreement": round(100 * sum(same) / len(same), 2),
        "changed_labels": len(same) - sum(same),
        "max_probability_change": float(change.max()),
        "p99_probability_change": float(np.percentile(change, 99)),
        "median_probability_change": float(np.median(change)),
        "changes": [float(f"{c:.4g}") for c in change],  # per row, for the plot
    }


def run(work: Path, per_task: int, size: int) -> dict[str, Any]:
    from fusionserve.serving.model.runtime import OnnxRunner

    folders = artifacts(work)
    runners = {p: OnnxRunner(f, THREADS, device="cpu") for p, f in folders.items()}
    if not runners["int8"].per_row_tasks:
        raise SystemExit(f"{folders['int8']}: the graph takes one task per run; mixed batches need a task per row")
    rows = sample(list(runners["fp32"].artifact.tasks), work, per_task)
    probs = {}
    for precision, runner in runners.items():
        print(f"{precision}: {len(rows)} rows", file=sys.stderr)
        probs[precision] = run_arrangements(runner, rows, size)
    result: dict[str, Any] = {"rows_per_task": per_task, "batch": size, "tasks": len(runners["fp32"].artifact.tasks)}
    result["int8 alone vs fp32 alone"] = against(probs["fp32"]["alone"], probs["int8"]["alone"])
    for precision in runners:
        result[precision] = {name: against(probs[precision]["alone"], probs[precision][name]) for name in ARRANGEMENTS}
    # fp32 is what the int8 gate holds int8 to: int8 inside each arrangement against fp32 alone
    result["int8 vs fp32 alone"] = {name: against(probs["fp32"]["alone"], probs["int8"][name]) for name in ARRANGEMENTS}
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    m, ref = machine(), result["int8 alone vs fp32 alone"]
    lines = [
        f"`{command}` on {m['cpu']} ({m['cores']} cores), onnxruntime {m['onnxruntime']}, {m['date']}. The built-in "
        f"model's 11-task artifact at 128 tokens and its `--precision int8` copy; {result['rows_per_task']} dev rows of "
        f"each of its {result['tasks']} tasks ({ref['rows']} rows), each run for its own task alone (a batch of one, "
        f"no padding) and inside batches of {result['batch']}; every figure is against the same row run alone in the "
        "same precision. Labels and probabilities do not depend on the machine's load.",
        "",
        "| precision | arrangement | label as alone % | labels changed | largest probability change | 99th percentile "
        "| median | int8: label as fp32 alone % |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for precision in ("fp32", "int8"):
        for name, r in result[precision].items():
            vs_fp32 = f"{result['int8 vs fp32 alone'][name]['agreement']:.2f}" if precision == "int8" else "-"
            lines.append(
                f"| {precision} | {name} | {r['agreement']:.2f} | {r['changed_labels']} of {r['rows']} | "
                f"{r['max_probability_change']:.3g} | {r['p99_probability_change']:.3g} | "
                f"{r['median_probability_change']:.3g} | {vs_fp32} |"
            )
    lines += [
        "",
        f"For scale, int8 alone against fp32 alone: label agreement {ref['agreement']:.2f}% ({ref['changed_labels']} "
        f"of {ref['rows']} labels differ), largest probability change {ref['max_probability_change']:.3f}, 99th "
        f"percentile {ref['p99_probability_change']:.3f}.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    bins = np.logspace(-9, 0, 46)
    for name, r in result["int8"].items():
        ax.hist(np.maximum(r["changes"], 1e-9), bins=bins, histtype="step", label=f"int8, {name}")
    ax.hist(np.maximum(result["int8 alone vs fp32 alone"]["changes"], 1e-9), bins=bins, histtype="step", linestyle=":",
            color="gray", label="int8 alone vs fp32 alone")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("a row's largest probability change against the row alone")
    ax.set_ylabel("rows")
    ax.set_title("default model, int8: a row's answer inside a batch against alone", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=32, help="dev rows per task (default 32)")
    p.add_argument("--batch", type=int, default=16, help="rows per batch (default 16)")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "int8_batches")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.int8_batches " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = run(args.workdir, args.rows, args.batch)
    data = {"command": command, "machine": machine(), "result": result}
    text = markdown(result, command)
    title = "int8: a row's answer against the rows batched with it (default model)"
    record(args.out, "int8_batches", title, data, lambda path: plot(result, path), text, not args.no_record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
