"""The ``fusionserve`` command. Each subcommand parses its options and calls one library function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from fusionserve import __version__
from fusionserve.errors import FusionServeError, InputError

from .artifact import MANIFEST, is_artifact, load_artifact, render_manifest
from .default import ensure_artifact
from .predictions import TextInput, batched, format_predictions, read_jsonl

if TYPE_CHECKING:
    from .calibrate import ActivationRunner


def _open_runner(model: str) -> ActivationRunner:
    """An artifact folder runs on ONNX Runtime; a spec file on the PyTorch model (needs the [export] extra)."""
    path = Path(model)
    if is_artifact(path):
        from .runtime import OnnxRunner

        return OnnxRunner(path)
    if path.is_dir():
        raise InputError(f"{model} is a folder without {MANIFEST}: give an artifact folder (`fusionserve export`) or a spec file")
    from fusionserve.export.predict import TorchRunner  # torch only when a spec is given

    return TorchRunner(path)


def predict(
    model: str,
    task: str,
    inputs: Iterator[tuple[int, TextInput | InputError]],
    out: TextIO,
    batch_size: int = 32,
    progress: bool = False,
) -> tuple[int, int]:
    """Classify ``inputs`` and write one JSON line per input, in order; a bad input gets an ``error`` line and
    the rest go on. Returns (predicted, failed). Raises FusionServeError for an unknown task or a bad model."""
    from tqdm import tqdm

    runner = _open_runner(model)
    labels = runner.labels
    if task not in labels:
        raise InputError(f"unknown task '{task}'; known tasks: {', '.join(labels)}")
    ok = failed = 0
    bar = tqdm(desc=f"predict {task}", unit="text", disable=not progress, file=sys.stderr)
    for batch in batched(inputs, batch_size):
        good = [(no, x) for no, x in batch if isinstance(x, TextInput)]
        rows: dict[int, dict[str, Any]] = {}
        if good:
            logits, truncated = runner.logits(task, [x for _, x in good])
            for (no, _), row in zip(good, format_predictions(labels[task], logits, truncated, [x for _, x in good]), strict=True):
                rows[no] = row
        for no, x in batch:
            if isinstance(x, InputError):
                rows[no] = {"line": no, "error": str(x)}
                bar.write(f"line {no}: {x}", file=sys.stderr)
                failed += 1
            else:
                ok += 1
            out.write(json.dumps(rows[no], ensure_ascii=False) + "\n")
        bar.update(len(batch))
    bar.close()
    return ok, failed


def inspect(model: str, as_json: bool) -> str:
    """Describe a spec (tasks, labels, adapters per layer, parameter counts) or an artifact (its manifest)."""
    if is_artifact(Path(model)):
        manifest = load_artifact(model).manifest
        return json.dumps(manifest, indent=2) if as_json else render_manifest(manifest)
    from fusionserve.export.model import build_model
    from fusionserve.export.spec import load_spec
    from fusionserve.export.summary import render, summarize

    spec = load_spec(model)
    summary = summarize(spec, build_model(spec))
    return json.dumps(summary, indent=2) if as_json else render(summary)


def _add_pruning_commands(sub: Any) -> None:
    """calibrate -> prune -> evaluate: measure fusion activations, drop the least used adapters, check accuracy."""
    default = "default: the built-in model"
    ca = sub.add_parser("calibrate", help="record how much weight each fusion layer gives each adapter on your inputs")
    ca.add_argument("model", nargs="?", help=f"artifact folder or model spec file; {default}")
    ca.add_argument("--task", required=True, action="append", help="fusion task to calibrate (repeat for several)")
    ca.add_argument(
        "--input", required=True, type=Path, help='JSONL, one {"text": ..., "text_pair": ...} per line (labels ignored)'
    )
    ca.add_argument("--output", type=Path, default=Path("stats.json"), help="statistics to write (default stats.json)")
    ca.add_argument("--plot", type=Path, help="heat map PNG (default: --output with .png)")
    ca.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")

    pn = sub.add_parser("prune", help="export a model whose fusions keep only their most used adapters")
    pn.add_argument("spec", nargs="?", help=f"model spec file; {default}")
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
    pn.add_argument("--precision", choices=["fp32", "fp16"], default="fp32", help="as for export (default fp32)")
    pn.add_argument("--max-seq-len", type=int, help="as for export (default: the tokenizer's; the built-in model: 128)")
    pn.add_argument("--force", action="store_true", help="replace --out if it exists")
    pn.add_argument("--eval", type=Path, metavar="FILE", help="labelled JSONL: print accuracy and latency before and after")
    pn.add_argument("--eval-task", help="task --eval is labelled for (default: the pruned task, when there is one)")
    pn.add_argument("--baseline", type=Path, help="the unpruned artifact for --eval (default: exported to a temporary folder)")

    ev = sub.add_parser("evaluate", help="accuracy of a task on labelled JSONL lines")
    ev.add_argument("model", nargs="?", help=f"artifact folder or model spec file; {default}")
    ev.add_argument("--task", required=True, help="task to evaluate")
    ev.add_argument("--input", required=True, type=Path, help='JSONL, one {"text": ..., "text_pair": ..., "label": ...} per line')
    ev.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    ev.add_argument("--json", action="store_true", help="print JSON instead of text")


def _report_bad(bad: Sequence[tuple[int, str]], total_hint: str) -> None:
    for no, why in bad[:20]:
        print(f"line {no}: {why}", file=sys.stderr)
    if len(bad) > 20:
        print(f"... and {len(bad) - 20} more", file=sys.stderr)
    if bad:
        print(f"{len(bad)} line(s) of {total_hint} skipped", file=sys.stderr)


def _run_pruning_command(args: argparse.Namespace) -> int:
    from .predictions import read_labelled_jsonl

    if getattr(args, "batch_size", 1) < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.command == "calibrate":
        from .calibrate import MissingDependency, calibrate, plot_heatmap, stats_document

        model = args.model if args.model is not None else str(ensure_artifact())
        stats, bad = calibrate(_open_runner(model), args.task, read_labelled_jsonl(args.input, False), args.batch_size, True)
        _report_bad(bad, str(args.input))
        doc = stats_document(stats, model, args.input, len(bad))
        args.output.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        try:
            png: Path | str = plot_heatmap(doc, args.plot or args.output.with_suffix(".png"))
        except MissingDependency as exc:  # the statistics are written; only the picture needs matplotlib
            print(f"fusionserve: warning: no heat map: {exc}", file=sys.stderr)
            png = "no heat map"
        for task, t in stats.items():
            ranked = sorted(t["mean_over_layers"].items(), key=lambda kv: -kv[1])
            print(f"{task}: {t['tokens']:,} tokens; mean weight over layers: " + ", ".join(f"{a} {v:.3f}" for a, v in ranked))
        print(f"wrote {args.output} and {png}")
        return 0
    if args.command == "evaluate":
        from .evaluate import evaluate

        model = args.model if args.model is not None else str(ensure_artifact())
        result = evaluate(_open_runner(model), args.task, read_labelled_jsonl(args.input, True), args.batch_size, True)
        _report_bad(result.bad, str(args.input))
        if args.json:
            print(json.dumps(result.as_dict(), indent=2))
        else:
            low, high = result.ci95
            print(
                f"{args.task}: accuracy {result.accuracy:.2f}% ({result.correct}/{result.examples}; 95% CI {low:.1f}-{high:.1f})"
            )
            for label, (n, c) in result.per_label.items():
                print(f"  {label:<24} {100 * c / n if n else 0:6.2f}% of {n}")
        return 0
    from fusionserve.export.prune import PruneRule, compare, prune_artifact, render

    from .default import DEFAULT_MODEL, MAX_SEQ_LEN, SPEC_FILE

    spec = args.spec if args.spec is not None else str(DEFAULT_MODEL / SPEC_FILE)
    max_seq_len = args.max_seq_len if args.max_seq_len is not None or args.spec is not None else MAX_SEQ_LEN
    rule = PruneRule(args.keep_top, args.min_activation, args.per_layer, tuple(args.drop_layers))
    if args.eval is not None and args.eval_task is None:
        from .calibrate import load_stats

        calibrated = list(load_stats(args.stats)["tasks"])
        if len(calibrated) != 1:
            raise InputError(f"--eval needs --eval-task: the stats cover {len(calibrated)} tasks ({', '.join(calibrated)})")
    manifest, plans = prune_artifact(spec, args.stats, rule, args.out, args.tasks, args.precision, max_seq_len, args.force)
    comparison = None
    if args.eval is not None:
        comparison = compare(
            spec, args.out, args.eval_task or next(iter(plans)), args.eval, args.tasks, args.baseline, max_seq_len
        )
    print(render(plans, manifest, comparison))
    print(f"wrote {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusionserve", description="Serve AdapterFusion models trained with AdapterHub.")
    p.add_argument("--version", action="version", version=f"fusionserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    ex = sub.add_parser("export", help="export a spec to a validated ONNX artifact folder")
    ex.add_argument("model", help="model spec file (YAML or JSON)")
    ex.add_argument("--out", required=True, type=Path, help="artifact folder to write")
    ex.add_argument(
        "--precision", choices=["fp32", "fp16"], default="fp32", help="fp16 halves the weights, for GPU (default fp32)"
    )
    ex.add_argument(
        "--max-seq-len",
        type=int,
        help="token limit recorded for serving (default: the tokenizer's, at most the model's positions)",
    )
    ex.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    ex.add_argument("--force", action="store_true", help="replace --out if it exists")
    ex.add_argument("--tasks", nargs="+", metavar="T", help="serve only these tasks of the spec (default: all)")

    pr = sub.add_parser("predict", help="classify texts with an artifact folder or a model spec")
    pr.add_argument(
        "model",
        nargs="?",
        help="artifact folder (ONNX Runtime) or model spec file (PyTorch); default: the built-in model, exported on first use",
    )
    pr.add_argument("--task", required=True, help="target task to run")
    src = pr.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="one text to classify")
    src.add_argument("--input", type=Path, help='JSONL file, one {"text": ..., "text_pair": ...} object per line')
    pr.add_argument("--text-pair", help="second text of a pair (with --text)")
    pr.add_argument("--output", type=Path, help="write JSONL here instead of standard output")
    pr.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")

    sc = sub.add_parser("score", help="score a JSONL, CSV or Parquet file: its rows plus label and score (resumable)")
    sc.add_argument("model", nargs="?", help="artifact folder; default: the built-in model, exported on first use")
    sc.add_argument("--task", required=True, help="task to run")
    sc.add_argument("--input", required=True, type=Path, help="rows to score: .jsonl / .json (JSON lines), .csv or .parquet")
    sc.add_argument("--output", type=Path, help="file to write, format from its extension (default: data.csv -> data.scored.csv)")
    sc.add_argument("--text-field", default="text", help="field (column) holding the text (default text)")
    sc.add_argument("--pair-field", help="field holding the second text of a pair (default: none)")
    sc.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    sc.add_argument("--chunk-size", type=int, default=1024, help="rows read, length-sorted and committed at once (default 1024)")
    sc.add_argument("--all-scores", action="store_true", help="add score_<label>: every label's probability")
    sc.add_argument(
        "--activations", action="store_true", help="add activation_<adapter>: mean fusion weight over layers and tokens"
    )
    sc.add_argument("--prefix", default="", help="put before every added column's name, e.g. pred_ (default: nothing)")
    sc.add_argument("--threads", type=int, help="ONNX Runtime threads (default: every CPU; with Ray: per actor, default 1)")
    sc.add_argument("--overwrite", action="store_true", help="start over instead of going on from an existing output")
    on_ray = sc.add_mutually_exclusive_group()
    on_ray.add_argument("--ray", action="store_true", help="run on Ray Data: a local Ray, or RAY_ADDRESS's cluster")
    on_ray.add_argument("--ray-address", help="run on Ray Data on this cluster")
    sc.add_argument("--ray-actors", type=int, help="scoring actors with --ray (default: Ray's CPUs / --threads)")

    sv = sub.add_parser("serve", help="serve an artifact over HTTP with Ray Serve (Ctrl-C stops)")
    sv.add_argument(
        "artifact",
        nargs="?",
        help="artifact folder written by `fusionserve export`; default: the built-in model, exported on first use",
    )
    sv.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1; see the README's security notes)")
    sv.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    sv.add_argument("--replicas", type=int, default=1, help="model replicas, each with its own ONNX Runtime session (default 1)")
    sv.add_argument("--threads", type=int, help="ONNX Runtime threads per replica (default: CPUs / replicas)")
    sv.add_argument("--max-batch-size", type=int, default=32, help="most texts in one model call (default 32)")
    sv.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a batch waits to fill (default 5)")
    sv.add_argument("--max-ongoing", type=int, help="requests a replica holds at once (default 4 x max batch size)")
    sv.add_argument("--max-queued", type=int, default=64, help="requests waiting for a replica before 503 (default 64)")
    sv.add_argument("--max-inputs", type=int, default=64, help="most inputs in one request, else 413 (default 64)")
    sv.add_argument("--max-body-bytes", type=int, default=1_000_000, help="largest request body, else 413 (default 1000000)")
    sv.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where replicas run: cuda needs onnxruntime-gpu (pip install 'fusionserve[gpu]') and a GPU Ray sees; "
        "auto takes it when both are there (default auto)",
    )

    _add_pruning_commands(sub)

    ins = sub.add_parser("inspect", help="describe a spec or an artifact: tasks, labels, adapters per layer, parameters")
    ins.add_argument("model", help="artifact folder or model spec file")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command in ("calibrate", "prune", "evaluate"):
            return _run_pruning_command(args)
        if args.command == "score":
            from .score import ScoreConfig, score_file

            job = ScoreConfig(
                model=Path(args.model) if args.model is not None else ensure_artifact(), task=args.task,
                input=args.input, output=args.output, text_field=args.text_field, pair_field=args.pair_field,
                batch_size=args.batch_size, chunk_size=args.chunk_size, all_scores=args.all_scores,
                activations=args.activations, prefix=args.prefix, threads=args.threads, overwrite=args.overwrite,
                ray=args.ray, ray_address=args.ray_address, ray_actors=args.ray_actors,
            )  # fmt: skip
            try:
                summary = score_file(job)
            except KeyboardInterrupt:  # every committed chunk is safe: say how to go on instead of a traceback
                print("fusionserve: interrupted; the same command goes on after the last committed chunk", file=sys.stderr)
                return 130
            print(summary.render())
            return 1 if summary.failed else 0
        if args.command == "inspect":
            print(inspect(args.model, args.json))
            return 0
        if args.command == "serve":
            from .server import ServerConfig, serve_forever

            artifact = Path(args.artifact) if args.artifact is not None else ensure_artifact()
            cfg = ServerConfig(
                artifact, args.host, args.port, args.replicas, args.max_batch_size, args.batch_wait_ms,
                args.max_queued, args.max_ongoing, args.max_inputs, args.max_body_bytes, args.threads, args.device,
            )  # fmt: skip
            serve_forever(cfg)
            return 0
        if args.command == "export":
            from fusionserve.export.artifact import export_artifact

            manifest = export_artifact(
                args.model, args.out, args.precision, args.max_seq_len, args.opset, args.force, tasks=args.tasks
            )
            print(
                f"wrote {args.out}: {len(manifest['tasks'])} task(s), {manifest['precision']}, "
                f"max |diff| vs PyTorch {manifest['parity']['max_abs_diff']['logits']:.2g}, {manifest['fused_operators']['summary']}"
            )
            return 0
        if args.batch_size < 1:
            raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
        if args.text_pair is not None and args.text is None:
            raise InputError("--text-pair needs --text")
        model = args.model if args.model is not None else str(ensure_artifact())
        if args.text is not None:
            inputs: Iterator[tuple[int, TextInput | InputError]] = iter([(1, TextInput(args.text, args.text_pair))])
        else:
            inputs = read_jsonl(args.input)
        out = args.output.open("w", encoding="utf-8") if args.output else sys.stdout
        try:
            ok, failed = predict(model, args.task, inputs, out, args.batch_size, progress=args.output is not None)
        finally:
            if args.output:
                out.close()
        if failed:
            print(f"{failed} of {ok + failed} inputs failed (error lines written in their place)", file=sys.stderr)
            return 1
        return 0
    except FusionServeError as exc:
        print(f"fusionserve: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
