"""int8 on the default model: what quantization costs in accuracy — the choices made on dev, the result on test.

    python -m benchmarks.int8 [--dev-limit 300] [--test-limit N] [--workdir DIR] [--reuse] [--no-record]

Artifacts, from the built-in model at its 64 tokens; the fp32 ones by ``export_artifact`` (parity grid 'quick', as the
built-in model's first start exports it), every int8 one by quantizing and gating that validated fp32 graph exactly as
``export --precision int8`` does (``models.int8_copy``):

- ``fp32``: the reference, all 11 tasks
- ``int8``: what ``--precision int8`` ships (weights one scale per output column, adapter path quantized, the FFN's
  output GEMM left in fp32)
- ``int8, everything quantized``: every Attention and constant-weight MatMul quantized (the default before); the
  variants below depart from it in one thing each:
- ``int8 per-tensor``: one scale per weight tensor
- ``int8 reduce-range``: weights in 7 bits (ONNX Runtime's advice for CPUs without VNNI)
- ``int8, adapter path fp32``: the adapter blocks' MatMuls left in fp32 (in this 11-task graph that is the stacked
  down-projection; the fusion matrices are chosen by the task index at run time and stay fp32 anyway)
- ``int8, attention QKV fp32`` / ``int8, attention fp32``: the fused Attention (Q/K/V projections) / it and the
  attention output projection left in fp32 in every layer
- ``int8, first layer fp32`` / ``last layer`` / ``first and last layer``: those backbone layers left wholly in fp32
- ``fp32 amazon_food only`` and ``int8 amazon_food only`` (shipped options), ``..., everything quantized`` and
  ``..., adapter path fp32``: the graph serving amazon_food alone, where the fusion matrices are constants and are
  quantized too

The measurement variants are made with their gate off (thresholds 0 and 1) so that their figures show; every
variant's gate figures (the export grid of random token ids) are recorded beside its dev figures. ``--reuse`` also
reuses the logits a previous run cached in --workdir/logits (by variant folder, task, split and number of rows).

Dev splits (at most --dev-limit examples per task, a seeded sample, and every example of the two target fusion tasks,
the targets of ``fusionserve.training.recipe``; the choices were made on these): per task, accuracy, label agreement with fp32 and the
largest change of a probability. Test splits, fp32 against the shipped int8: every served task, every example for
the target fusions, at most --test-limit (a seeded sample) for each other task.
Writes benchmarks/results/int8.json and .png, its section of benchmarks/RESULTS.md and the int8 section of
fusionserve/default_model/REPORT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from benchmarks.report import machine, record, write_section
from fusionserve.training.recipe import TARGETS

HERE = Path(__file__).parent
REPORT = Path(__file__).resolve().parent.parent / "fusionserve" / "default_model" / "REPORT.md"
THREADS = 2
SEQ = 64  # the default model's token limit (trained and served at 64 tokens)


def _variants() -> dict[str, dict[str, Any]]:
    """name -> how it is made: exported ('tasks'), or quantized from the fp32 artifact 'of' with 'int8' options."""
    from dataclasses import replace

    from fusionserve.export.int8.quantize import DEFAULT_OPTIONS, Int8Gate, Int8Options

    # every measured variant departs from "everything quantized" (the default until the FFN-output comparison), as it
    # was measured then: per-tensor activation scales, no smoothing (issue 28's per-row default: benchmarks/int8_smooth.py)
    base = Int8Options(fp32_roles=(), gate=Int8Gate(0.0, 1.0), smooth_alpha=None, activations="tensor")
    one = "fp32 amazon_food only"
    return {
        "fp32": {"tasks": None},
        "int8": {"of": "fp32", "int8": DEFAULT_OPTIONS},
        "int8, everything quantized": {"of": "fp32", "int8": base},
        "int8 per-tensor": {"of": "fp32", "int8": replace(base, per_channel=False)},
        "int8, adapter path fp32": {"of": "fp32", "int8": replace(base, adapter_path=False)},
        "int8 reduce-range": {"of": "fp32", "int8": replace(base, reduce_range=True)},
        "int8, attention QKV fp32": {"of": "fp32", "int8": replace(base, fp32_roles=("attention_qkv",))},
        "int8, attention fp32": {"of": "fp32", "int8": replace(base, fp32_roles=("attention_qkv", "attention_out"))},
        "int8, first layer fp32": {"of": "fp32", "int8": replace(base, fp32_layers=(0,))},
        "int8, last layer fp32": {"of": "fp32", "int8": replace(base, fp32_layers=(-1,))},
        "int8, first and last layer fp32": {"of": "fp32", "int8": replace(base, fp32_layers=(0, -1))},
        "int8, FFN output GEMM fp32 in layers 0-2": {"of": "fp32", "int8": replace(base, fp32_roles=_ffn_out(0, 1, 2))},
        "int8, FFN output GEMM fp32 in layers 3-5": {"of": "fp32", "int8": replace(base, fp32_roles=_ffn_out(3, 4, 5))},
        "int8, FFN output GEMM fp32 in layer 0": {"of": "fp32", "int8": replace(base, fp32_roles=_ffn_out(0))},
        "int8, first layer and FFN output GEMM fp32": {
            "of": "fp32",
            "int8": replace(base, fp32_roles=("ffn_out",), fp32_layers=(0,)),
        },
        one: {"tasks": ["amazon_food"]},
        "int8 amazon_food only": {"of": one, "int8": DEFAULT_OPTIONS},
        "int8 amazon_food only, everything quantized": {"of": one, "int8": base},
        "int8 amazon_food only, adapter path fp32": {"of": one, "int8": replace(base, adapter_path=False)},
    }


def _ffn_out(*layers: int) -> tuple[str, ...]:
    return tuple(f"ffn_out:{i}" for i in layers)


def folder_name(name: str) -> str:
    return name.replace(" ", "_").replace(",", "")


def artifacts(spec: Path, work: Path, reuse: bool) -> dict[str, Path]:
    """Every variant's artifact folder under ``work``; with ``reuse``, one that has a manifest is kept as it is."""
    from benchmarks.models import int8_copy
    from fusionserve.export.artifact import export_artifact

    out: dict[str, Path] = {}
    for name, v in _variants().items():
        folder = out[name] = work / folder_name(name)
        if reuse and (folder / "manifest.json").is_file():
            continue
        print(f"making {name}", file=sys.stderr)
        if "of" in v:
            shutil.rmtree(folder, ignore_errors=True)
            int8_copy(out[v["of"]], folder, spec, v["int8"])
        else:
            export_artifact(spec, folder, "fp32", SEQ, force=True, tasks=v["tasks"], parity_grid="quick")
    return out


def _split(dataset: str, split: str, work: Path, limit: int | None) -> list[dict[str, Any]]:
    from fusionserve.training.datasets import load, write_jsonl
    from fusionserve.training.recipe import Recipe, target_data

    path = work / f"{dataset}.{split}.jsonl"
    if not path.is_file():  # a target's splits are the ones its REPORT.md uses (recipe.target_data)
        write_jsonl(target_data(dataset, Recipe()) if dataset in TARGETS else load(dataset), split, path)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    if not limit or limit >= len(rows):
        return rows
    # a seeded sample, not the first rows: some splits are sorted by label (20 Newsgroups' test split)
    keep = np.sort(np.random.default_rng(0).choice(len(rows), limit, replace=False))
    return [rows[i] for i in keep]


def _logits(runner: Any, task: str, rows: list[dict[str, Any]], batch: int = 32) -> np.ndarray:
    """(rows, labels) logits in input order, exactly as ``fusionserve predict`` computes them (``predict_logits``: texts
    of similar length batched together, ``batch`` per batch). Before issue 38 this sorted the whole split by length
    itself while predict batched in file order, and int8's figures here were not what a user met (98.94% against
    99.36% on amazon_food's test split: docs/guides/int8.md)."""
    from fusionserve.scoring.predict import WINDOW_BATCHES, predict_logits
    from fusionserve.serving.model.predictions import TextInput

    texts, window = [TextInput(r["text"], r.get("text_pair")) for r in rows], batch * WINDOW_BATCHES
    parts = [predict_logits(runner, task, texts[i : i + window], batch)[0] for i in range(0, len(texts), window)]
    return np.concatenate(parts) if parts else np.zeros((0, len(runner.labels[task])), dtype=np.float32)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def compare(reference: np.ndarray, other: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Accuracy of both, label agreement and the largest probability change of ``other`` against ``reference``."""
    ref, got = reference.argmax(-1), other.argmax(-1)
    return {
        "examples": len(labels),
        "accuracy_ref": round(100 * float((ref == labels).mean()), 2),
        "accuracy": round(100 * float((got == labels).mean()), 2),
        "agreement": round(100 * float((ref == got).mean()), 2),
        "max_probability_change": round(float(np.abs(_softmax(other) - _softmax(reference)).max()), 4),
    }


def _cached(runner: Any, name: str, task: str, rows: list[dict[str, Any]], split: str, cache: Path | None) -> np.ndarray:
    """``_logits``, kept in ``cache`` (a --reuse run's workdir/logits) by variant, task, split and number of rows."""
    if cache is None:
        return _logits(runner, task, rows)
    path = cache / f"{folder_name(name)}.{task}.{split}.{len(rows)}.npy"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, _logits(runner, task, rows))
    return np.load(path)


def evaluate_split(
    runners: dict[str, Any],
    split: str,
    work: Path,
    limit: int | None,
    full: tuple[str, ...] = (),
    cache: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Per variant (but the fp32 ones) and task it serves: ``compare`` against the fp32 graph of the same tasks.
    At most ``limit`` examples of each task but those in ``full``."""
    out: dict[str, dict[str, Any]] = {name: {} for name in runners if not name.startswith("fp32")}
    for task in runners["fp32"].artifact.tasks:
        dataset = task.removesuffix("_adapter").removesuffix("_head")
        rows = _split(dataset, split, work, None if task in full else limit)
        labels = runners["fp32"].task(task).labels
        y = np.array([labels.index(r["label"]) for r in rows])
        print(f"{split} {task}: {len(rows)} examples", file=sys.stderr)
        logits = {n: _cached(r, n, task, rows, split, cache) for n, r in runners.items() if task in r.artifact.tasks}
        for name in out:
            if name in logits:
                ref = "fp32 amazon_food only" if "amazon_food only" in name else "fp32"
                out[name][task] = compare(logits[ref], logits[name], y)
    return out


def _sizes(folder: Path) -> dict[str, Any]:
    from fusionserve.serving.model.artifact import load_artifact

    manifest = load_artifact(folder).manifest
    sizes: dict[str, Any] = {"model_mb": round((folder / "model.onnx").stat().st_size / 2**20, 1)}
    if "int8" in manifest:
        by_type = manifest["int8"]["quantization"]["weights_by_type"]
        sizes["int8_weights"] = by_type.get("int8", 0)
        sizes["float_weights"] = by_type.get("float32", 0)
    return sizes


def run(spec: Path, work: Path, dev_limit: int, test_limit: int | None, reuse: bool) -> dict[str, Any]:
    from fusionserve.serving.model.artifact import load_artifact
    from fusionserve.serving.model.runtime import OnnxRunner

    work.mkdir(parents=True, exist_ok=True)
    folders = artifacts(spec, work, reuse)
    runners = {name: OnnxRunner(f, THREADS, device="cpu") for name, f in folders.items()}
    int8 = {n: load_artifact(f).manifest.get("int8") for n, f in folders.items()}
    gates = {n: r["gate"] for n, r in int8.items() if r}
    cache = work / "logits" if reuse else None
    dev = evaluate_split(runners, "dev", work, dev_limit, TARGETS, cache)
    test = evaluate_split({k: runners[k] for k in ("fp32", "int8")}, "test", work, test_limit, TARGETS, cache)
    return {
        "dev_limit": dev_limit,
        "test_limit": test_limit,
        "gates": {n: {k: g[k] for k in ("label_agreement", "rows", "max_probability_change")} for n, g in gates.items() if g},
        "dev": dev,
        "test": test["int8"],
        "sizes": {n: _sizes(f) for n, f in folders.items() if n in ("fp32", "int8")},
        "quantized": {n: _quantized(r["quantization"]) for n, r in int8.items() if r},
    }


def _quantized(q: dict[str, Any]) -> dict[str, Any]:
    """What a variant quantized: int8 MatMuls and Attentions out of all, and the weights stored as int8."""
    return {op: f"{q['quantized'][op]}/{q['of'][op]}" for op in q["quantized"]} | {
        "int8_weights": q["weights_by_type"].get("int8", 0)
    }


def _pooled(per_task: dict[str, dict[str, Any]]) -> dict[str, float]:
    n = sum(r["examples"] for r in per_task.values())
    agree = sum(r["agreement"] * r["examples"] for r in per_task.values()) / n
    lowest = min(per_task, key=lambda t: per_task[t]["agreement"])
    return {"examples": n, "agreement": round(agree, 2), "min_agreement": per_task[lowest]["agreement"], "lowest": lowest}


def _table(per_task: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| task | n | fp32 accuracy % | int8 accuracy % | int8 / fp32 | label agreement % | max probability change |"]
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for task, r in per_task.items():
        kept = 100 * r["accuracy"] / r["accuracy_ref"] if r["accuracy_ref"] else float("nan")
        lines.append(
            f"| {task} | {r['examples']} | {r['accuracy_ref']:.1f} | {r['accuracy']:.1f} | {kept:.1f}% | "
            f"{r['agreement']:.1f} | {r['max_probability_change']:.3f} |"
        )
    return lines


def markdown(result: dict[str, Any], command: str) -> tuple[str, str]:
    """(the RESULTS.md section, the REPORT.md section)."""
    m = machine()
    head = (
        f"`{command}` on {m['cpu']} ({m['cores']} cores), onnxruntime {m['onnxruntime']}, {m['date']}. The built-in "
        f"model exported at {SEQ} tokens; int8 = `--precision int8` (dynamic quantization, weights one scale per output "
        "column, activations one scale per tensor at run time, the FFN's output GEMM left in fp32). Agreement and "
        "probability change are against the fp32 graph of the same tasks; they do not depend on the machine's load "
        "(no speed is measured here)."
    )
    limit = result.get("test_limit")
    which = f"every example for the target fusions, at most {limit} for each other task" if limit else "every example"
    lines = [
        head,
        "",
        f"**Choices, on the dev splits** (at most {result['dev_limit']} examples per task, every example of the target fusions):",
        "",
    ]
    lines += [
        f"| variant | rows | pooled label agreement % | lowest task % | {TARGETS[0]} (whole dev) % | {TARGETS[1]} % "
        "| int8 MatMul / Attention | int8 weights | gate grid: agreement / max prob. change |"
    ]
    lines.append("|---|---:|---:|---:|---:|---:|---|---:|---|")
    for name, per_task in result["dev"].items():
        p, g, q = _pooled(per_task), result["gates"].get(name), result.get("quantized", {}).get(name, {})
        grid = f"{100 * g['label_agreement']:.1f}% / {g['max_probability_change']:.3f}" if g else "-"
        # a graph that does not serve a target (the single-task variants) has no figure for it: "-", not nan
        amazon, other = (
            f"{per_task[t]['agreement']:.{d}f}" if t in per_task else "-" for t, d in zip(TARGETS[:2], (2, 1), strict=True)
        )
        lines.append(
            f"| {name} | {p['examples']} | {p['agreement']:.2f} | {p['min_agreement']:.1f} ({p['lowest']}) | {amazon} "
            f"| {other} | {q.get('MatMul', '?')} / {q.get('Attention', '?')} | {q.get('int8_weights', 0):,} | {grid} |"
        )
    reached = [n for n, t in result["dev"].items() if t.get(TARGETS[0], {}).get("agreement", 0) >= 99]
    lines += [
        "",
        f"Variants whose label agreement on {TARGETS[0]}'s whole dev split is >= 99%: {', '.join(reached) or 'none'}.",
    ]
    lines += ["", f"**Shipped int8 on the test splits** (every served task; {which}):", "", *_table(result["test"])]
    targets = {t: result["test"][t] for t in TARGETS if t in result["test"]}
    verdict = [
        f"{t}: keeps {100 * r['accuracy'] / r['accuracy_ref']:.1f}% of fp32's accuracy (target >= 99%: "
        f"{'met' if r['accuracy'] >= 0.99 * r['accuracy_ref'] else 'NOT met'}), label agreement {r['agreement']:.1f}% "
        f"(target >= 99%: {'met' if r['agreement'] >= 99 else 'NOT met'})"
        for t, r in targets.items()
    ]
    s32, s8 = result["sizes"]["fp32"], result["sizes"]["int8"]
    size = (
        f"model.onnx {s32['model_mb']} MB fp32, {s8['model_mb']} MB int8 ({s32['model_mb'] / s8['model_mb']:.2f}x smaller); "
        f"{s8['int8_weights']:,} weights stored as int8 (4x smaller than fp32: 1 byte each, plus a scale per column), "
        f"{s8['float_weights']:,} stay float (embeddings, LayerNorms, heads, the FFN output GEMMs, the task-selected "
        "fusion matrices)."
    )
    lines += ["", *[f"- {v}" for v in verdict], f"- Size: {size}", ""]
    report = "\n".join(
        [
            head,
            "",
            f"Test splits of every served task ({which}):",
            "",
            *_table(result["test"]),
            "",
            *[f"- {v}" for v in verdict],
            f"- Size: {size}",
            "",
        ]
    )
    return "\n".join(lines), report


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["test"])
    x = np.arange(len(tasks))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.8 * len(tasks)), 4.2))
    ax.bar(x - 0.2, [result["test"][t]["accuracy_ref"] for t in tasks], 0.4, label="fp32")
    ax.bar(x + 0.2, [result["test"][t]["accuracy"] for t in tasks], 0.4, label="int8")
    for i, t in enumerate(tasks):
        ax.annotate(f"{result['test'][t]['agreement']:.1f}", (i, 2), ha="center", fontsize=7, rotation=90)
    ax.set_xticks(x, tasks, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy (%); label agreement in the bars")
    ax.set_title("default model: fp32 vs int8 on every served task's test split", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    from fusionserve.cli.default import DEFAULT_MODEL, SPEC_FILE

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", type=Path, default=DEFAULT_MODEL / SPEC_FILE, help="model spec (default: the built-in model)")
    p.add_argument("--dev-limit", type=int, default=300, help="most dev examples per task (default 300)")
    p.add_argument("--test-limit", type=int, help="most test examples of each task but the target fusions (default: all)")
    p.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "fusionserve" / "bench" / "int8")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-record", action="store_true", help="do not rewrite RESULTS.md and REPORT.md")
    p.add_argument("--reuse", action="store_true", help="reuse the artifacts a previous run left in --workdir (same spec)")
    args = p.parse_args(argv)
    command = ("python -m benchmarks.int8 " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    result = run(args.spec, args.workdir, args.dev_limit, args.test_limit, args.reuse)
    data = {"command": command, "machine": machine(), "result": result}
    text, report = markdown(result, command)
    record(args.out, "int8", "int8 accuracy (default model)", data, lambda path: plot(result, path), text, not args.no_record)
    if not args.no_record:
        write_section(REPORT, "int8", "int8 (CPU) against fp32", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
