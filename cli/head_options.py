"""The options of heads beyond classification, the same on ``predict`` and ``score`` as on POST /v1/classify: a
tagging task's aggregation strategy, a question-answering task's top_k, max_answer_len, handle_impossible_answer and
doc_stride. Their checks are the serving side's (``HeadOptions``): an unknown strategy, or an option no task reads,
is one line naming the option."""

from __future__ import annotations

import argparse
from typing import Any

NAMES = ("aggregation_strategy", "top_k", "max_answer_len", "handle_impossible_answer", "doc_stride")


def add_head_options(parser: Any) -> None:
    group = parser.add_argument_group("heads beyond classification (tagging, question answering)")
    group.add_argument(
        "--aggregation-strategy",
        metavar="STRATEGY",
        help="tagging tasks: none, simple, first, average or max, grouping word pieces into entities as transformers' "
        "token-classification pipeline does (default none: one prediction per word piece)",
    )
    group.add_argument("--top-k", type=int, help="question answering: the best answers to give (default 1)")
    group.add_argument("--max-answer-len", type=int, help="question answering: longest answer in tokens (default 15)")
    group.add_argument(
        "--handle-impossible-answer",
        action="store_true",
        default=None,
        help="question answering: the empty answer may win (SQuAD 2.0 style)",
    )
    group.add_argument(
        "--doc-stride",
        type=int,
        help="question answering: tokens two windows of a long context share (default min(token limit / 2, 128))",
    )


def head_options(args: argparse.Namespace) -> dict[str, Any]:
    """The head options given on the command line (those left out stay None: the default applies)."""
    return {name: getattr(args, name) for name in NAMES}
