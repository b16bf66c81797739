"""``fusionserve calibrate``, ``prune`` and ``evaluate``: measure fusion activations, drop the least used
adapters, check accuracy — and ``prune --eval``, which puts the pruned model beside the unpruned one."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fusionserve.errors import InputError, MissingDependency
from fusionserve.serving.model.artifact import PRECISIONS

from . import default
from .model_commands import add_int8_fp32, int8_options
from .runners import open_runner

_DEFAULT = "default: the built-in model"


def add_pruning(sub: Any) -> None:
    """calibrate -> prune -> evaluate: measure fusion activations, drop the least used adapters, check accuracy."""
    ca = sub.add_parser("calibrate", help="record how much weight each fusion layer gives each adapter on your inputs")
    ca.add_argument("model", nargs="?", help=f"artifact folder or model spec file; {_DEFAULT}")
    ca.add_argument("--task", required=True, action="append", help="fusion task to calibrate (repeat for several)")
    ca.add_argument(
        "--input", required=True, type=Path, help='JSONL, one {"text": ..., "text_pair": ...} per line (labels ignored)'
    )
    ca.add_argument("--output", type=Path, default=Path("stats.json"), help="statistics to write (default stats.json)")
    ca.add_argument("--plot", type=Path, help="heat map PNG (default: --output with .png)")
    ca.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    ca.set_defaults(run=run_calibrate, needs="serve")
    _add_prune(sub)
    ev = sub.add_parser("evaluate", help="a task's usual metric on labelled JSONL lines (accuracy, correlation, F1, EM)")
    ev.add_argument("model", nargs="?", help=f"artifact folder or model spec file; {_DEFAULT}")
    ev.add_argument("--task", required=True, help="task to evaluate")
    ev.add_argument(
        "--input",
        required=True,
        type=Path,
        help='JSONL, one labelled input per line: {"text", "text_pair"?, "label"} (classification, regression), {"text", '
        '"choices", "label"} (multiple choice), {"tokens", "tags"} (tagging), {"question", "context", "answers"} (QA)',
    )
    ev.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of text")
    ev.set_defaults(run=run_evaluate, needs="serve")


def _add_prune(sub: Any) -> None:
    pn = sub.add_parser("prune", help="export a model whose fusions keep only their most used adapters")
    pn.add_argument("spec", nargs="?", help=f"model spec file; {_DEFAULT}")
    pn.add_argument("--stats", required=True, type=Path, help="statistics written by `fusionserve calibrate`")
    how = pn.add_mutually_exclusive_group(required=True)
    how.add_argument("--keep-top", type=int, metavar="K", help="keep the K adapters with the highest mean weight")
    how.add_argument("--min-activation", type=float, metavar="X", help="keep the adapters whose mean weight is at least X")
    pn.add_argument("--per-layer", action="store_true", help="choose in each layer on its own (default: one choice for all)")
    pn.add_argument(
        "--drop-layers", type=int, nargs="+", default=[], metavar="L", help="drop the fusion in these layers (-1: last)"
    )
    pn.add_argument("--tasks", nargs="+", metavar="T", help="serve only these tasks (default: every task of the spec)")
    pn.add_argument("--out", required=True, type=Path, help="artifact folder to write")
    pn.add_argument("--precision", choices=PRECISIONS, default="fp32", help="as for export (default fp32)")
    add_int8_fp32(pn)
    pn.add_argument("--max-seq-len", type=int, help="as for export (default: the spec's max_seq_len, else the tokenizer's)")
    pn.add_argument("--force", action="store_true", help="replace --out if it exists")
    pn.add_argument("--eval", type=Path, metavar="FILE", help="labelled JSONL: print accuracy and latency before and after")
    pn.add_argument("--eval-task", help="task --eval is labelled for (default: the pruned task, when there is one)")
    pn.add_argument("--baseline", type=Path, help="the unpruned artifact for --eval (default: exported to a temporary folder)")
    pn.set_defaults(run=run_prune, needs="export")


def _report_bad(bad: Sequence[tuple[int, str]], total_hint: str) -> None:
    for no, why in bad[:20]:
        print(f"line {no}: {why}", file=sys.stderr)
    if len(bad) > 20:
        print(f"... and {len(bad) - 20} more", file=sys.stderr)
    if bad:
        print(f"{len(bad)} line(s) of {total_hint} skipped", file=sys.stderr)


def _check_batch_size(args: argparse.Namespace) -> None:
    if getattr(args, "batch_size", 1) < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")


def run_calibrate(args: argparse.Namespace) -> int:
    from fusionserve.scoring.calibrate import calibrate, plot_heatmap
    from fusionserve.scoring.files import check_output, model_files, open_output
    from fusionserve.scoring.inputs import read_labelled_jsonl
    from fusionserve.serving.model.activations import stats_document

    _check_batch_size(args)
    inputs = [args.input, *(model_files(args.model) if args.model else [])]
    plot = args.plot or args.output.with_suffix(".png")
    check_output(args.output, inputs)  # before the run: its result must have somewhere to go
    if plot.resolve() == args.output.resolve():
        raise InputError(f"--plot {plot} is --output too; name another file for the heat map")
    check_output(plot, inputs, "--plot")
    model = args.model if args.model is not None else str(default.ensure_artifact())
    stats, bad = calibrate(open_runner(model), args.task, read_labelled_jsonl(args.input, False), args.batch_size, True)
    _report_bad(bad, str(args.input))
    doc = stats_document(stats, model, args.input, len(bad))
    with open_output(args.output, "w", inputs) as fh:
        fh.write(json.dumps(doc, indent=2) + "\n")
    try:
        png: Path | str = plot_heatmap(doc, plot)
    except MissingDependency as exc:  # the statistics are written; only the picture needs matplotlib
        print(f"fusionserve: warning: no heat map: {exc}", file=sys.stderr)
        png = "no heat map"
    for task, t in stats.items():
        ranked = sorted(t["mean_over_layers"].items(), key=lambda kv: -kv[1])
        print(f"{task}: {t['tokens']:,} tokens; mean weight over layers: " + ", ".join(f"{a} {v:.3f}" for a, v in ranked))
    print(f"wrote {args.output} and {png}")
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from fusionserve.scoring.evaluate import evaluate
    from fusionserve.scoring.evaluate_heads import evaluate_head
    from fusionserve.scoring.inputs import read_labelled_jsonl
    from fusionserve.serving.model.heads import CLASSIFICATION, head

    _check_batch_size(args)
    model = args.model if args.model is not None else str(default.ensure_artifact())
    runner = open_runner(model)
    if head(runner.task(args.task)) != CLASSIFICATION:  # regression, multiple choice, tagging, question answering
        other = evaluate_head(runner, args.task, args.input, args.batch_size, True)
        _report_bad(other.bad, str(args.input))
        print(json.dumps(other.as_dict(), indent=2) if args.json else other.render())
        return 0
    result = evaluate(runner, args.task, read_labelled_jsonl(args.input, True), args.batch_size, True)
    _report_bad(result.bad, str(args.input))
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        low, high = result.ci95
        print(f"{args.task}: accuracy {result.accuracy:.2f}% ({result.correct}/{result.examples}; 95% CI {low:.1f}-{high:.1f})")
        for label, (n, c) in result.per_label.items():
            print(f"  {label:<24} {100 * c / n if n else 0:6.2f}% of {n}")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    from fusionserve.export.prune import PruneRule, prune_artifact, render
    from fusionserve.serving.model.activations import load_stats

    spec = args.spec if args.spec is not None else str(default.DEFAULT_MODEL / default.SPEC_FILE)
    max_seq_len = args.max_seq_len
    rule = PruneRule(args.keep_top, args.min_activation, args.per_layer, tuple(args.drop_layers))
    if args.eval is not None and args.eval_task is None:
        calibrated = list(load_stats(args.stats)["tasks"])
        if len(calibrated) != 1:
            raise InputError(f"--eval needs --eval-task: the stats cover {len(calibrated)} tasks ({', '.join(calibrated)})")
    int8 = int8_options(args)
    manifest, plans = prune_artifact(
        spec, args.stats, rule, args.out, args.tasks, args.precision, max_seq_len, args.force, int8=int8
    )
    text = render(plans, manifest)
    if args.eval is not None:
        task = args.eval_task or next(iter(plans))
        text += "\n" + render_comparison(
            compare(spec, args.out, task, args.eval, args.tasks, args.baseline, max_seq_len, precision=args.precision, int8=int8)
        )
    print(text)
    print(f"wrote {args.out}")
    return 0


def compare(
    spec_path: str | Path,
    pruned: Path,
    task: str,
    eval_input: Path,
    tasks: Sequence[str] | None = None,
    baseline: Path | None = None,
    max_seq_len: int | None = None,
    batch_size: int = 32,
    progress: bool = True,
    precision: str = "fp32",
    int8: Any = None,
) -> dict[str, Any]:
    """Accuracy on ``eval_input`` and latency (batch 16, seq 128 or the token limit) of ``task`` before and after pruning, both on
    ONNX Runtime. The unpruned model is exported (at ``precision``, the pruned one's, so that only pruning differs) to a
    temporary folder unless ``baseline`` names its artifact."""
    from fusionserve.export.artifact import export_artifact
    from fusionserve.export.prune import PruneError
    from fusionserve.scoring.evaluate import evaluate
    from fusionserve.scoring.inputs import read_labelled_jsonl
    from fusionserve.scoring.timing import latency_ms
    from fusionserve.serving.model.runtime import OnnxRunner

    scratch = None
    try:
        if baseline is None:
            scratch = Path(tempfile.mkdtemp(prefix="fusionserve-unpruned-"))
            baseline = scratch / "artifact"
            if progress:
                print("exporting the unpruned model to compare against", file=sys.stderr)
            extra = {"int8": int8} if int8 is not None else {}  # the pruned model's int8 options: only pruning differs
            export_artifact(spec_path, baseline, precision, max_seq_len=max_seq_len, tasks=tasks, progress=progress, **extra)
        runners = {"unpruned": OnnxRunner(baseline, device="cpu"), "pruned": OnnxRunner(pruned, device="cpu")}
        for name, runner in runners.items():
            if task not in runner.artifact.tasks:
                raise PruneError(
                    f"--eval-task '{task}' is not served by the {name} model; tasks: {', '.join(runner.artifact.tasks)}"
                )
        result: dict[str, Any] = {"task": task, "input": str(eval_input)}
        for name, runner in runners.items():
            result[name] = evaluate(runner, task, read_labelled_jsonl(eval_input, True), batch_size, progress).as_dict()
        seq = min(128, *(r.encoder.max_length for r in runners.values()))
        latency = latency_ms({name: (runner, task) for name, runner in runners.items()}, batch=16, seq=seq)
        result["latency"] = {"batch": 16, "seq": seq}
        for name in runners:
            result[name]["latency_ms"] = round(latency[name], 2)
        return result
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def render_comparison(comparison: Mapping[str, Any]) -> str:
    """The before/after table ``prune --eval`` prints under the pruning summary."""
    before, after = comparison["unpruned"], comparison["pruned"]
    lines = [
        f"{comparison['task']} on {comparison['input']} ({before['examples']} examples; latency: batch 16, seq {comparison['latency']['seq']}, median):",
        f"  {'':10} {'accuracy %':>22} {'latency ms':>11}",
        f"  {'unpruned':10} {before['accuracy']:>6.2f} [{before['ci95'][0]:.1f}, {before['ci95'][1]:.1f}]{'':>1} {before['latency_ms']:>11.2f}",
        f"  {'pruned':10} {after['accuracy']:>6.2f} [{after['ci95'][0]:.1f}, {after['ci95'][1]:.1f}]{'':>1} {after['latency_ms']:>11.2f}",
        f"  pruned keeps {100 * after['accuracy'] / max(before['accuracy'], 1e-9):.1f}% of the accuracy at "
        f"{after['latency_ms'] / before['latency_ms']:.2f}x the latency",
    ]
    return "\n".join(lines)
