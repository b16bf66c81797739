"""What each head kind takes and answers, whatever carried the call (HTTP, gRPC, ``predict``, ``score``, ``evaluate``):
the input shape a head takes, the options it reads, the rows the model runs for one input, and the answer made of
those rows' outputs. numpy and tokenizers only.

Rows: classification, regression and tagging run one row per input (its text, or pair); multiple choice one row per
choice (the pair context, choice, encoded as the tokenizer encodes a text pair); extractive question answering one row
per window of the pair (question, context) (``qa.windows``: question first, the context cut in overlapping windows).
Every row counts as one input against the limits that count inputs (a request's ``--max-inputs``, a batch's size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from fusionserve.errors import InputError

from ..options import MAX_TOP_K
from .artifact import TaskEntry
from .predictions import SHAPES, ChoiceInput, Input, QAInput, TextInput, choice_scores, label_logits, label_scores
from .qa import MAX_ANSWER_LEN, TOP_K, windows
from .qa import answer as span_answer
from .tagging import check_aggregation, tag
from .tokenize import Encoder, Tokens

CLASSIFICATION, REGRESSION, MULTIPLE_CHOICE = "classification", "regression", "multiple_choice"
TAGGING, QUESTION_ANSWERING = "tagging", "question_answering"
HEADS = (CLASSIFICATION, REGRESSION, MULTIPLE_CHOICE, TAGGING, QUESTION_ANSWERING)
TAKES: dict[str, type] = {
    CLASSIFICATION: TextInput, REGRESSION: TextInput, TAGGING: TextInput, MULTIPLE_CHOICE: ChoiceInput,
    QUESTION_ANSWERING: QAInput,
}  # fmt: skip
INPUT_FORMS = {
    TextInput: '"a text" or {"text": ..., "text_pair": ...}',
    ChoiceInput: '{"text": context, "choices": [...]}',
    QAInput: '{"question": ..., "context": ...}',
}
INPUT_FIELDS = {  # the fields of an input object each head takes (a plain string is a text)
    CLASSIFICATION: ("text", "text_pair"), REGRESSION: ("text", "text_pair"), TAGGING: ("text",),
    MULTIPLE_CHOICE: ("text", "choices"), QUESTION_ANSWERING: ("question", "context"),
}  # fmt: skip
QA_OPTIONS = ("top_k", "max_answer_len", "handle_impossible_answer", "doc_stride")
OPTIONS_READ = {TAGGING: ("aggregation_strategy",), QUESTION_ANSWERING: QA_OPTIONS}  # the options each head reads
# the defaults of the Hugging Face question-answering pipeline (doc_stride: qa.default_doc_stride of the token limit)
QA_DEFAULTS = {"top_k": TOP_K, "max_answer_len": MAX_ANSWER_LEN, "handle_impossible_answer": False}


def head(entry: TaskEntry) -> str:
    """The task's head kind (one of HEADS; ``TaskEntry.head``)."""
    return entry.head


def as_flag(exc: InputError) -> InputError:
    """``exc`` of ``HeadOptions`` named as a command's option: "top_k must be ..." -> "--top-k must be ..."."""
    first, _, rest = str(exc).partition(" ")
    known = {f.name for f in fields(HeadOptions)}
    return InputError(f"--{first.replace('_', '-')} {rest}") if first in known else exc


@dataclass(frozen=True)
class HeadOptions:
    """The options a request (or a file job) gives for its tasks' heads; None: not given (the default applies).
    ``aggregation_strategy`` is read by tagging heads, the others by question answering. Raises InputError naming the
    option, its value and what is allowed."""

    aggregation_strategy: str | None = None
    top_k: int | None = None
    max_answer_len: int | None = None
    handle_impossible_answer: bool | None = None
    doc_stride: int | None = None

    def __post_init__(self) -> None:
        if self.aggregation_strategy is not None:
            check_aggregation(self.aggregation_strategy)
        bounds = {"top_k": (1, MAX_TOP_K), "max_answer_len": (1, None), "doc_stride": (0, None)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
                allowed = f"{low}..{high}" if high is not None else f">= {low}"
                raise InputError(f"{name} must be a whole number {allowed}, got {value!r:.40}")
        impossible = self.handle_impossible_answer
        if impossible is not None and not isinstance(impossible, bool):
            raise InputError(f"handle_impossible_answer must be true or false, got {impossible!r:.40}")

    def given(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def qa(self, name: str) -> Any:
        value = getattr(self, name)
        return QA_DEFAULTS[name] if value is None else value

    def check(self, entries: Sequence[TaskEntry], raw: bool = False, max_length: int | None = None) -> None:
        """Raises InputError for an option that no task of ``entries`` reads (a strategy given for a classification
        task answers nothing different: refused rather than ignored), for raw scores asked with an aggregation or of a
        question-answering task, and for a ``doc_stride`` not below the model's token limit ``max_length``."""
        if max_length is not None and self.doc_stride is not None and self.doc_stride >= max_length:
            raise InputError(
                f"doc_stride must be a whole number 0..{max_length - 1} (below the model's token limit of {max_length}), "
                f"got {self.doc_stride}"
            )
        heads = {head(e) for e in entries}
        for name in self.given():
            reads = next(kind for kind, names in OPTIONS_READ.items() if name in names)
            if reads not in heads:
                named = ", ".join(f"'{e.name}' is {head(e)}" for e in entries[:5])
                raise InputError(f"{name} applies to {reads} tasks only; {named}")
        check_aggregation(self.aggregation_strategy or "none", raw)
        qa = next((e for e in entries if head(e) == QUESTION_ANSWERING), None)
        if raw and qa is not None:
            raise InputError(
                f"raw_scores: task '{qa.name}' is question_answering, whose score is the product of an answer's start and "
                "end probabilities (summed over the windows that read it): it has no logits of its own to give"
            )


def check_input(entry: TaskEntry, inp: Input) -> None:
    """Raises InputError when ``inp`` is not the shape the task's head takes (naming both)."""
    kind = head(entry)
    wants = TAKES[kind]
    if isinstance(inp, wants) and not (kind == TAGGING and isinstance(inp, TextInput) and inp.text_pair is not None):
        return
    if kind == TAGGING:
        what = "a pair" if isinstance(inp, TextInput) else SHAPES[type(inp)]
        raise InputError(f'task \'{entry.name}\' is {kind}: it tags one text ("a text" or {{"text": ...}}); this input is {what}')
    missing = {ChoiceInput: "'choices'", QAInput: "'question' and 'context'"}.get(wants)
    got = SHAPES[type(inp)] + (f", without {missing}" if missing else "")
    raise InputError(f"task '{entry.name}' is {kind}: an input is {INPUT_FORMS[wants]}; this one is {got}")


def row_key(kind: str) -> str:
    """Heads with equal keys make the same rows of an input (classification and regression: its text): tokenized once."""
    return "text" if kind in (CLASSIFICATION, REGRESSION) else kind


@dataclass(frozen=True)
class Unit:
    """One input for one task: the rows the model runs, and what turns their outputs into the answer."""

    rows: tuple[Tokens, ...]
    truncated: bool  # a row was cut to the token limit (never for QA: a long context is read in windows)
    detail: Any = None  # tagging: (tokenizers Encoding, offset shift, tokenizer); QA: the windows
    error: InputError | None = None  # the input cannot be made into rows (a question too long for a window): no rows


def units(encoder: Encoder, kind: str, inputs: Sequence[Input], truncation: str, options: HeadOptions) -> list[Unit]:
    """Per input, its rows for a head of ``kind`` (see the module docstring); inputs must be the shape the head takes
    (``check_input``). An input that cannot be made into rows gets a Unit with its ``error`` and no rows. Raises
    ValueError for an unknown kind."""
    if kind in (CLASSIFICATION, REGRESSION):
        return [Unit((t,), t.truncated) for t in encoder.tokens(inputs, truncation)]  # type: ignore[arg-type]
    if kind == TAGGING:
        tagged = encoder.tagged(inputs, truncation)  # type: ignore[arg-type]
        return [Unit((t,), t.truncated, (enc, shift, encoder.tokenizer)) for t, enc, shift in tagged]
    if kind == MULTIPLE_CHOICE:
        pairs = [TextInput(i.text, c) for i in inputs for c in i.choices]  # type: ignore[union-attr]
        tokens, out, at = encoder.tokens(pairs, truncation), [], 0
        for i in inputs:
            rows = tuple(tokens[at : at + len(i.choices)])  # type: ignore[union-attr]
            out.append(Unit(rows, any(r.truncated for r in rows)))
            at += len(rows)
        return out
    if kind == QUESTION_ANSWERING:
        out = []
        for i in inputs:
            try:
                win = windows(encoder.tokenizer, i.question, i.context, encoder.max_length, options.doc_stride)  # type: ignore[union-attr]
            except InputError as exc:  # this input only: the caller says which one (a request fails, a file row is reported)
                out.append(Unit((), False, error=exc))
                continue
            out.append(Unit(tuple(Tokens(w.ids, w.type_ids, False) for w in win), False, win))
        return out
    raise ValueError(f"unknown head kind {kind!r}; known: {', '.join(HEADS)}")


def answer(
    entry: TaskEntry, inp: Input, unit: Unit, outputs: Sequence[np.ndarray], options: HeadOptions, raw: bool = False
) -> Any:
    """The prediction for one input (JSON-ready) from its rows' ``outputs``: per row the head's logits, (labels,) for a
    sequence-level head, (tokens, labels) for a token-level one. ``raw``: logits, unrounded, instead of rounded
    probabilities (regression: the value unrounded; tagging: each token's logits added; question answering has none)."""
    kind = head(entry)
    cut = {"truncated": bool(unit.truncated)}
    if kind == CLASSIFICATION:
        label, score, scores = (label_logits if raw else label_scores)(entry.labels, outputs[0][None])[0]
        return {"label": label, "score": score, "scores": scores, **cut}
    if kind == REGRESSION:
        value = float(outputs[0][0])
        return {"score": value if raw else round(value, 6), **cut}
    if kind == MULTIPLE_CHOICE:
        return {**choice_scores(inp.choices, np.stack(outputs), raw), **cut}  # type: ignore[union-attr]
    if kind == TAGGING:
        return {**_tag(entry, inp, unit, outputs[0], options, raw), **cut}
    if kind == QUESTION_ANSWERING:
        return _answer_question(inp, unit, outputs, options)
    raise ValueError(f"unknown head kind {kind!r}; known: {', '.join(HEADS)}")


def _tag(entry: TaskEntry, inp: Input, unit: Unit, logits: np.ndarray, options: HeadOptions, raw: bool) -> dict[str, Any]:
    enc, shift, tokenizer = unit.detail
    offsets = [(s + shift, e + shift) for s, e in enc.offsets] if shift else enc.offsets
    strategy = options.aggregation_strategy or "none"
    text = inp.text  # type: ignore[union-attr]
    return tag(tokenizer, text, entry.labels, logits, enc.ids, offsets, enc.special_tokens_mask, strategy, raw)


def _answer_question(inp: Input, unit: Unit, outputs: Sequence[np.ndarray], options: HeadOptions) -> Any:
    """The best answer (top_k 1), or the top_k best as a list (as the pipeline answers); raw scores are refused for QA
    (``HeadOptions.check``)."""
    start = [o[:, 0] for o in outputs]
    end = [o[:, 1] for o in outputs]
    found = span_answer(
        unit.detail, start, end, inp.context, options.qa("top_k"), options.qa("max_answer_len"),  # type: ignore[union-attr]
        options.qa("handle_impossible_answer"),
    )  # fmt: skip
    return found[0] if options.qa("top_k") == 1 and found else found


def probe(kind: str) -> Input:
    """A small input a task of ``kind`` takes: what a readiness check sends."""
    return {ChoiceInput: ChoiceInput("ready", ("yes", "no")), QAInput: QAInput("ready?", "ready")}.get(
        TAKES[kind], TextInput("ready")
    )
