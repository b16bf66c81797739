"""``fusionserve score``: a JSONL, CSV or Parquet file scored row by row, resumable."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fusionserve.scoring.files import MAX_ROW_BYTES

from . import default
from .head_options import add_head_options, head_options


def add_score(sub: Any) -> None:
    sc = sub.add_parser("score", help="score a JSONL, CSV or Parquet file: its rows plus label and score (resumable)")
    sc.add_argument("model", nargs="?", help="artifact folder; default: the built-in model, exported on first use")
    sc.add_argument(
        "--task", required=True, action="append", help="task to run; repeat for several (each adds <task>_label, ... in one pass)"
    )
    sc.add_argument("--input", required=True, type=Path, help="rows to score: .jsonl / .json (JSON lines), .csv or .parquet")
    sc.add_argument("--output", type=Path, help="file to write, format from its extension (default: data.csv -> data.scored.csv)")
    sc.add_argument("--text-field", default="text", help="field (column) holding the text (default text)")
    sc.add_argument("--pair-field", help="field holding the second text of a pair (default: none)")
    sc.add_argument(
        "--choices-field",
        default="choices",
        help="multiple-choice tasks: field holding the choices, a list (in CSV a JSON array); the context is --text-field "
        "(default choices)",
    )
    sc.add_argument(
        "--question-field", default="question", help="question-answering tasks: field of the question (default question)"
    )
    sc.add_argument("--context-field", default="context", help="question-answering tasks: field of the context (default context)")
    sc.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    sc.add_argument("--chunk-size", type=int, default=1024, help="rows read, length-sorted and committed at once (default 1024)")
    sc.add_argument(
        "--max-row-bytes",
        type=int,
        default=MAX_ROW_BYTES,
        help=f"a longer row is listed as bad and the job goes on (default {MAX_ROW_BYTES:,}, 1 MiB)",
    )
    sc.add_argument("--all-scores", action="store_true", help="add score_<label>: every label's probability")
    sc.add_argument(
        "--raw-scores", action="store_true", help="score (and score_<label>) hold the model's logits instead of probabilities"
    )
    sc.add_argument(
        "--truncation-direction",
        choices=["right", "left"],
        default="right",
        help="where a text over the token limit is cut: right keeps its first tokens, left its last (default right)",
    )
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
    add_head_options(sc)
    sc.set_defaults(run=run_score, needs="batch")


def run_score(args: argparse.Namespace) -> int:
    from fusionserve.scoring.config import ScoreConfig
    from fusionserve.scoring.score import score_file

    job = ScoreConfig(
        model=Path(args.model) if args.model is not None else default.ensure_artifact(),
        task=args.task[0] if len(args.task) == 1 else tuple(args.task),
        input=args.input, output=args.output, text_field=args.text_field, pair_field=args.pair_field,
        batch_size=args.batch_size, chunk_size=args.chunk_size, max_row_bytes=args.max_row_bytes, all_scores=args.all_scores,
        activations=args.activations, prefix=args.prefix, threads=args.threads, overwrite=args.overwrite,
        ray=args.ray, ray_address=args.ray_address, ray_actors=args.ray_actors,
        truncation_direction=args.truncation_direction, raw_scores=args.raw_scores, choices_field=args.choices_field,
        question_field=args.question_field, context_field=args.context_field, **head_options(args),
    )  # fmt: skip
    try:
        summary = score_file(job)
    except KeyboardInterrupt:  # every committed chunk is safe: say how to go on instead of a traceback
        print("fusionserve: interrupted; the same command goes on after the last committed chunk", file=sys.stderr)
        return 130
    print(summary.render())
    return 1 if summary.failed else 0
