"""The ``fusionserve`` command. Each subcommand parses its options and calls one library function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from fusionserve import __version__
from fusionserve.errors import FusionServeError, InputError

from .artifact import MANIFEST, is_artifact, load_artifact, render_manifest
from .default import ensure_artifact
from .predictions import Runner, TextInput, format_predictions, read_jsonl


def _open_runner(model: str) -> Runner:
    """An artifact folder runs on ONNX Runtime; a spec file on the PyTorch model (needs the [export] extra)."""
    path = Path(model)
    if is_artifact(path):
        from .runtime import OnnxRunner

        return OnnxRunner(path)
    if path.is_dir():
        raise InputError(f"{model} is a folder without {MANIFEST}: give an artifact folder (`fusionserve export`) or a spec file")
    from fusionserve.export.predict import TorchRunner  # torch only when a spec is given

    return TorchRunner(path)


def _batches(
    items: Iterator[tuple[int, TextInput | InputError]], size: int
) -> Iterator[list[tuple[int, TextInput | InputError]]]:
    batch: list[tuple[int, TextInput | InputError]] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


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
    for batch in _batches(inputs, batch_size):
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

    ins = sub.add_parser("inspect", help="describe a spec or an artifact: tasks, labels, adapters per layer, parameters")
    ins.add_argument("model", help="artifact folder or model spec file")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect(args.model, args.json))
            return 0
        if args.command == "serve":
            from .server import ServerConfig, serve_forever

            artifact = Path(args.artifact) if args.artifact is not None else ensure_artifact()
            cfg = ServerConfig(
                artifact, args.host, args.port, args.replicas, args.max_batch_size, args.batch_wait_ms,
                args.max_queued, args.max_ongoing, args.max_inputs, args.max_body_bytes, args.threads,
            )  # fmt: skip
            serve_forever(cfg)
            return 0
        if args.command == "export":
            from fusionserve.export.artifact import export_artifact

            manifest = export_artifact(args.model, args.out, args.precision, args.max_seq_len, args.opset, args.force)
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
