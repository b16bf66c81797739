"""``fusionserve export``, ``predict`` and ``inspect``: a spec or an artifact, turned into an artifact, answers, or
a description."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from fusionserve.errors import InputError

# no torch, no onnx: the parser needs no export extra
from fusionserve.export.int8.gemm_roles import (
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    DEFAULT_FP32_ROLES,
    DEFAULT_METHOD,
    DEFAULT_SMOOTH_ALPHA,
    METHODS,
    ROLES,
)
from fusionserve.scoring.files import MAX_ROW_BYTES  # no pyarrow, no onnxruntime: the parser needs no extra
from fusionserve.serving.model.artifact import PRECISIONS, is_artifact, load_artifact, render_bf16, render_int8, render_manifest
from fusionserve.serving.model.predictions import ChoiceInput, Input, QAInput, TextInput

from . import default
from .head_options import add_head_options, head_options
from .runners import open_runner


def add_export(sub: Any) -> None:
    ex = sub.add_parser("export", help="export a spec to a validated ONNX artifact folder")
    ex.add_argument("model", help="model spec file (YAML or JSON)")
    ex.add_argument("--out", required=True, type=Path, help="artifact folder to write")
    ex.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp16 halves the weights, for GPU; int8 quantizes the GEMMs, for CPU; bf16 runs the GEMMs in bf16 with "
        "OpenVINO, for CPUs with bf16 units (AMX, AVX-512 BF16; needs fusionserve[openvino]) (default fp32)",
    )
    add_int8_fp32(ex)
    ex.add_argument(
        "--max-seq-len",
        type=int,
        help="token limit recorded for serving (default: the spec's max_seq_len, else the tokenizer's, at most the model's positions)",
    )
    ex.add_argument(
        "--opset",
        type=int,
        default=17,
        help="ONNX opset (default 17; one the export cannot write is refused at once, naming the range)",
    )
    ex.add_argument("--force", action="store_true", help="replace --out if it exists")
    ex.add_argument("--tasks", nargs="+", metavar="T", help="serve only these tasks of the spec (default: all)")
    ex.add_argument(
        "--parity-grid",
        choices=["full", "quick"],
        default="full",
        help="full: every task at every (batch, sequence) of the grid; quick: the whole grid for one task of each kind "
        "(fusion, adapter, head only; sequence- and token-level heads apart) and one padded case for every other task "
        "(default full)",
    )
    ex.add_argument(
        "--live",
        action="store_true",
        help="keep every task's weights beside the graph, not in it, so that `fusionserve tasks` can add, replace and "
        "remove tasks later and a running server picks them up (docs/guides/live-tasks.md)",
    )
    ex.set_defaults(run=run_export, needs="export")


def add_int8_fp32(parser: Any) -> None:
    """The int8 options of ``export`` and ``prune``: the GEMMs left in fp32, smoothing, the method, the calibration."""
    parser.add_argument(
        "--int8-fp32",
        nargs="+",
        metavar="ROLE",
        help="with --precision int8: the backbone GEMMs left in fp32, in every layer (ROLE) or one (ROLE:LAYER, -1 the "
        f"last); roles: {', '.join(ROLES)}; 'none' quantizes them all: faster, less close to fp32 (docs/guides/int8.md). "
        f"Default: {', '.join(DEFAULT_FP32_ROLES) or 'none'}",
    )
    parser.add_argument(
        "--int8-smooth",
        metavar="ALPHA",
        help="with --precision int8: SmoothQuant's alpha in [0, 1] (move the activations' outlier channels into the "
        f"weights before quantizing), or 'none'. Default: {DEFAULT_SMOOTH_ALPHA if DEFAULT_SMOOTH_ALPHA is not None else 'none'}",
    )
    parser.add_argument(
        "--int8-method",
        choices=list(METHODS),
        help="with --precision int8: dynamic (activation scales per batch at run time) or static (QDQ, scales fixed "
        f"by the calibration rows). Default: {DEFAULT_METHOD}",
    )
    parser.add_argument(
        "--int8-activations",
        choices=list(ACTIVATIONS),
        help="with --precision int8 --int8-method dynamic: one activation scale per row (token) for the backbone's "
        "attention output and feed-forward GEMMs (row), or one per tensor (tensor: ONNX Runtime's own; for a CPU "
        f"without VNNI, see docs/guides/int8.md). Default: {DEFAULT_ACTIVATIONS}",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help='with --precision int8: JSONL, one {"text": ..., "text_pair": ...} per line, the texts smoothing and '
        "static quantization are calibrated on (default: the validation grid's random token ids)",
    )


def int8_options(args: argparse.Namespace) -> Any:
    """The Int8Options of the int8 flags (the defaults where none is given). Raises InputError for an unknown role, an
    alpha outside [0, 1], a calibration file that is empty or not texts (naming it), or a flag without --precision int8."""
    from fusionserve.export.int8.quantize import DEFAULT_OPTIONS

    given = {
        f: getattr(args, f.replace("-", "_"), None)
        for f in ("int8-fp32", "int8-smooth", "int8-method", "int8-activations", "calibration")
    }
    if all(v is None for v in given.values()):
        return DEFAULT_OPTIONS
    if args.precision != "int8":
        flag = next(f for f, v in given.items() if v is not None)
        raise InputError(f"--{flag} is for --precision int8 (this is --precision {args.precision})")
    changes: dict[str, Any] = {}
    if args.int8_fp32 is not None:
        changes["fp32_roles"] = () if args.int8_fp32 == ["none"] else tuple(args.int8_fp32)
    if args.int8_smooth is not None:
        changes["smooth_alpha"] = None if args.int8_smooth == "none" else _alpha(args.int8_smooth)
    if args.int8_method is not None:
        changes["method"] = args.int8_method
    if args.int8_activations is not None:
        changes["activations"] = args.int8_activations
    if args.calibration is not None:
        from fusionserve.export.int8.calibration import read_calibration

        read_calibration(args.calibration)  # refused now, not after minutes of export
        changes["calibration"] = str(args.calibration)
    try:
        return replace(DEFAULT_OPTIONS, **changes)
    except ValueError as exc:
        raise InputError(f"--int8-fp32: {exc}".replace("fp32_roles: ", "")) from None


def _alpha(text: str) -> float:
    try:
        alpha = float(text)
    except ValueError:
        alpha = -1.0
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"--int8-smooth: expected a number in [0, 1] or 'none', got '{text}'")
    return alpha


def run_export(args: argparse.Namespace) -> int:
    if args.precision == "bf16":  # a CPU that cannot run bf16: refused at once, before the export's imports (torch)
        from fusionserve.serving.model.openvino_runtime import require_bf16_here

        require_bf16_here()
    from fusionserve.export.artifact import export_artifact

    manifest = export_artifact(
        args.model,
        args.out,
        args.precision,
        args.max_seq_len,
        args.opset,
        args.force,
        tasks=args.tasks,
        parity_grid=args.parity_grid,
        int8=int8_options(args),
        live=args.live,
    )
    print(
        f"wrote {args.out}: {len(manifest['tasks'])} task(s), {manifest['precision']}, "
        f"max |diff| vs PyTorch {_head_diff(manifest['parity']['max_abs_diff']):.2g}, {manifest['fused_operators']['summary']}"
    )
    for line in render_int8(manifest.get("int8")) + render_bf16(manifest.get("bf16")):
        print(line)
    return 0


def _head_diff(diffs: dict[str, float]) -> float:
    """The parity gate's worst head output: logits, and token logits where the graph has them."""
    return max(v for k, v in diffs.items() if k in ("logits", "token_logits"))


def add_predict(sub: Any) -> None:
    pr = sub.add_parser("predict", help="run texts through a task of an artifact folder or a model spec")
    pr.add_argument(
        "model",
        nargs="?",
        help="artifact folder (ONNX Runtime) or model spec file (PyTorch); default: the built-in model, exported on first use",
    )
    pr.add_argument("--task", required=True, help="target task to run")
    src = pr.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="one text to run (a multiple-choice task: the context)")
    src.add_argument("--question", help="question-answering tasks: one question (with --context)")
    src.add_argument(
        "--input",
        type=Path,
        help='JSONL file, one input per line: {"text": ..., "text_pair": ...}, {"text": ..., "choices": [...]} '
        '(multiple choice) or {"question": ..., "context": ...} (question answering)',
    )
    pr.add_argument("--text-pair", help="second text of a pair (with --text)")
    pr.add_argument("--choice", action="append", help="multiple-choice tasks: a choice (with --text); give 2 or more")
    pr.add_argument("--context", help="question-answering tasks: the text the answer is a span of (with --question)")
    pr.add_argument("--raw-scores", action="store_true", help="scores hold the model's logits instead of probabilities")
    pr.add_argument("--output", type=Path, help="write JSONL here instead of standard output")
    pr.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    pr.add_argument(
        "--max-row-bytes",
        type=int,
        default=MAX_ROW_BYTES,
        help=f"with --input: a longer line gets an error line and the rest go on (default {MAX_ROW_BYTES:,}, 1 MiB)",
    )
    add_head_options(pr)
    pr.set_defaults(run=run_predict, needs="serve")


def run_predict(args: argparse.Namespace) -> int:
    from fusionserve.scoring.files import check_output, model_files, open_output
    from fusionserve.scoring.inputs import read_jsonl
    from fusionserve.scoring.predict import predict
    from fusionserve.serving.model.heads import HeadOptions, as_flag

    for name in ("batch_size", "max_row_bytes"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for flag, needs in (("text_pair", "text"), ("choice", "text"), ("context", "question"), ("question", "context")):
        if getattr(args, flag) is not None and getattr(args, needs) is None:
            raise InputError(f"--{flag.replace('_', '-')} needs --{needs}")
    if args.text_pair is not None and args.choice is not None:
        raise InputError("--text-pair and --choice: give one (a pair, or a multiple-choice input)")
    if args.output is not None:  # before anything runs: the output is none of the inputs and can be written
        check_output(args.output, [*([args.input] if args.input else []), *(model_files(args.model) if args.model else [])])
    model = args.model if args.model is not None else str(default.ensure_artifact())
    if args.text is not None or args.question is not None:
        inputs: Iterator[tuple[int, Input | InputError]] = iter([(1, _one_input(args))])
    else:
        inputs = read_jsonl(args.input, args.max_row_bytes)
    try:
        options = HeadOptions(**head_options(args))
    except InputError as exc:
        raise as_flag(exc) from None
    out = open_output(args.output) if args.output else sys.stdout
    try:
        ok, failed = predict(
            open_runner(model), args.task, inputs, out, args.batch_size, progress=args.output is not None,
            options=options, raw=args.raw_scores,
        )  # fmt: skip
    except InputError as exc:
        raise as_flag(exc) from None
    finally:
        if args.output:
            out.close()
    if failed:
        print(f"{failed} of {ok + failed} inputs failed (error lines written in their place)", file=sys.stderr)
        return 1
    return 0


def _one_input(args: argparse.Namespace) -> Input:
    """The input --text (--text-pair | --choice ...) or --question --context give. Raises InputError naming the flag."""
    if args.question is not None:
        return QAInput(args.question, args.context)
    if args.choice is not None:
        return ChoiceInput(args.text, tuple(args.choice))
    return TextInput(args.text, args.text_pair)


def add_inspect(sub: Any) -> None:
    ins = sub.add_parser("inspect", help="describe a spec or an artifact: tasks, labels, adapters per layer, parameters")
    ins.add_argument("model", help="artifact folder or model spec file")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    ins.set_defaults(run=run_inspect, needs="serve")


def inspect(model: str, as_json: bool) -> str:
    """Describe a spec (tasks, labels, adapters per layer, parameter counts) or an artifact (its manifest)."""
    if is_artifact(Path(model)):
        manifest = load_artifact(model).manifest
        return json.dumps(manifest, indent=2) if as_json else render_manifest(manifest)
    from fusionserve.export.build import build_model
    from fusionserve.export.spec import load_spec
    from fusionserve.export.summary import render, summarize

    spec = load_spec(model)
    summary = summarize(spec, build_model(spec))
    return json.dumps(summary, indent=2) if as_json else render(summary)


def run_inspect(args: argparse.Namespace) -> int:
    print(inspect(args.model, args.json))
    return 0
