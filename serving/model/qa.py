"""Extractive question answering: the windows a (question, context) pair is read in, and the span search that picks
the answers from the windows' start and end logits, as ``transformers.pipeline("question-answering")`` reads and
picks them (transformers 4.57, fast tokenizer), so that the same logits give the same answers, characters and scores.
numpy and ``tokenizers`` only.

Windows: the question first and whole, then as much of the context as fits in ``max_length`` tokens; a longer
context continues in further windows, each repeating the last ``doc_stride`` context tokens of the one before (what
the tokenizer's ``only_second`` truncation with a stride gives). No part of the context is dropped.

Span search, per window: the start and end logits outside the context (question, separators) are set to -10000, each
is softmaxed over the window (float32); [CLS]'s probability product is the window's "no answer" score, then [CLS] is
zeroed; every span of the context with start <= end < start + ``max_answer_len`` scores start_p x end_p; the best
``2 * top_k + 10`` (``top_k`` when ``align_to_words`` is off) are mapped to characters (widened to whole words by
default). Answers are then gathered over the windows: a span whose text equals an answer found before (ignoring
case) adds its score to that answer's, so a span read in two overlapping windows counts twice. With
``handle_impossible_answer`` the empty answer "" (start = end = 0) competes with the lowest "no answer" score of the
windows. The ``top_k`` best are returned, best first.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer

from fusionserve.errors import InputError

from ..options import meaningful

MAX_DOC_STRIDE = 128  # the pipeline's default doc_stride is min(max_length // 2, 128)
TOP_K, MAX_ANSWER_LEN = 1, 15  # the pipeline's defaults
SCORE_DIGITS = 6  # as label_scores rounds probabilities
_MASKED = -10000.0  # the logit the pipeline gives tokens outside the context
_NULL_START = 1000000.0  # the pipeline's starting "no answer" score: any window's is lower


@dataclass(frozen=True)
class QAWindow:
    """One window of a (question, context) pair as the model reads it: [CLS] question [SEP] context part [SEP]."""

    ids: np.ndarray  # (n,) int64, unpadded
    type_ids: np.ndarray  # (n,) int64
    offsets: np.ndarray  # (n, 2) int64: characters of the context for context tokens (others: of the question, or 0, 0)
    context_mask: np.ndarray  # (n,) bool: the token is part of the context
    span_mask: np.ndarray  # (n,) bool: an answer may start or end here: the context's tokens and [CLS]
    word_spans: np.ndarray  # (n, 2) int64: characters of the word a context token belongs to (in this window), else -1

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


def default_doc_stride(max_length: int) -> int:
    """The pipeline's default overlap: half a window, at most MAX_DOC_STRIDE tokens."""
    return min(max_length // 2, MAX_DOC_STRIDE)


_COPIES: dict[int, tuple[Tokenizer, Tokenizer, threading.Lock]] = {}  # id -> (the caller's, kept alive; ours; its lock)
_COPIES_LOCK = threading.Lock()


def _copy(tokenizer: Tokenizer) -> tuple[Tokenizer, threading.Lock]:
    """A private copy of ``tokenizer`` (made once per tokenizer) whose truncation each call sets under the lock: the
    caller's settings (a saved tokenizer.json may carry padding and truncation) are left as they are."""
    with _COPIES_LOCK:
        hit = _COPIES.get(id(tokenizer))
        if hit is None:
            copy = Tokenizer.from_str(tokenizer.to_str())
            copy.no_padding()
            if len(_COPIES) >= 8:
                _COPIES.pop(next(iter(_COPIES)))
            hit = _COPIES[id(tokenizer)] = (tokenizer, copy, threading.Lock())
        return hit[1], hit[2]


def windows(tokenizer: Tokenizer, question: str, context: str, max_length: int, doc_stride: int | None = None) -> list[QAWindow]:
    """The windows the pair is read in (see the module), in context order; ``doc_stride`` defaults to
    ``default_doc_stride(max_length)``. The question is never cut (the pipeline's fast path does not cut it either).

    Raises InputError for an empty question or context (or one of which the tokenizer keeps nothing), a doc_stride
    out of range, or a question so long that a window leaves no more than ``doc_stride`` tokens for the context."""
    for name, text in (("question", question), ("context", context)):
        if not isinstance(text, str) or not meaningful(text):
            raise InputError(f"{name!r} must be a non-empty string, got {text!r:.80}")
    stride = default_doc_stride(max_length) if doc_stride is None else doc_stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 0 <= stride < max_length:
        raise InputError(f"doc_stride = {stride!r} is out of range; allowed: 0..{max_length - 1} (below max_length {max_length})")
    tok, lock = _copy(tokenizer)
    with lock:
        tok.no_truncation()
        n_question = len(tok.encode(question, add_special_tokens=False).ids)
        added = tok.post_processor.num_special_tokens_to_add(True) if tok.post_processor is not None else 0
        room = max_length - n_question - added  # context tokens per window
        # the tokenizer refuses (a panic, not an exception) to cut a context into parts no longer than the stride
        if room <= stride and len(tok.encode(context, add_special_tokens=False).ids) > room:
            raise InputError(
                f"the question is {n_question} tokens: a window of {max_length} tokens leaves {max(room, 0)} for the "
                f"context, which must be more than doc_stride ({stride}); shorten the question or lower doc_stride"
            )
        tok.enable_truncation(max_length, stride=stride, strategy="only_second", direction="right")
        pair = tok.encode(question, context)
    if 1 not in pair.sequence_ids:  # e.g. only combining accents, which an uncased tokenizer strips
        raise InputError(f"'context' holds nothing the tokenizer keeps, got {context!r:.80}")
    return [_window(e) for e in [pair, *pair.overflowing]]


def _window(enc: Encoding) -> QAWindow:
    ids = np.asarray(enc.ids, dtype=np.int64)
    context = np.asarray([s == 1 for s in enc.sequence_ids], dtype=bool)
    spans = np.full((len(ids), 2), -1, dtype=np.int64)
    for i in np.flatnonzero(context):
        word = enc.token_to_word(int(i))
        chars = enc.word_to_chars(word, 1) if word is not None else None  # the word's characters in this window
        if chars is not None:
            spans[i] = chars
    allowed = context.copy()
    if enc.special_tokens_mask[0]:
        allowed |= ids == ids[0]  # [CLS] stays a candidate: some models point at it for "no answer"
    return QAWindow(
        ids=ids,
        type_ids=np.asarray(enc.type_ids, dtype=np.int64),
        offsets=np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2),
        context_mask=context,
        span_mask=allowed,
        word_spans=spans,
    )


def check_options(top_k: int = TOP_K, max_answer_len: int = MAX_ANSWER_LEN) -> None:
    """Raise InputError for a top_k or max_answer_len below 1 (or not an integer)."""
    for name, value in (("top_k", top_k), ("max_answer_len", max_answer_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} = {value!r} is out of range; allowed: an integer >= 1")


def answer(
    windows: Sequence[QAWindow],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    context: str,
    top_k: int = TOP_K,
    max_answer_len: int = MAX_ANSWER_LEN,
    handle_impossible_answer: bool = False,
    align_to_words: bool = True,
) -> list[dict[str, Any]]:
    """The ``top_k`` best answers ``{"answer", "score", "start", "end"}`` (characters of ``context``), best first;
    fewer when the context holds fewer spans. ``start_logits[i]`` / ``end_logits[i]``: window i's logits, (seq,)
    with seq >= its length (padding past it is ignored).

    Raises InputError for a top_k or max_answer_len below 1, ValueError when the logits do not fit the windows."""
    check_options(top_k, max_answer_len)
    if not (len(windows) == len(start_logits) == len(end_logits)) or not windows:
        raise ValueError(f"{len(windows)} windows with {len(start_logits)} start and {len(end_logits)} end logit rows")
    candidates = 2 * top_k + 10 if align_to_words else top_k  # some spans map to the same words
    null_score = _NULL_START
    answers: list[dict[str, Any]] = []
    by_text: dict[str, dict[str, Any]] = {}  # lower-cased text -> the answer first found with it (the pipeline scans a list)
    for w, start, end in zip(windows, start_logits, end_logits, strict=True):
        starts, ends, scores, null_score = _spans(w, start, end, null_score, candidates, max_answer_len, handle_impossible_answer)
        for s, e, score in zip(starts, ends, scores, strict=True):
            first, last = _chars(w, int(s), int(e), align_to_words)
            text = context[first:last]
            same = by_text.get(text.lower())
            if same is not None:
                same["score"] += score.item()
            else:
                by_text[text.lower()] = {"answer": text, "score": score.item(), "start": first, "end": last}
                answers.append(by_text[text.lower()])
    if handle_impossible_answer:
        answers.append({"answer": "", "score": null_score, "start": 0, "end": 0})
    best = sorted(answers, key=lambda a: a["score"], reverse=True)[:top_k]
    return [{**a, "score": round(a["score"], SCORE_DIGITS)} for a in best]


def _spans(
    w: QAWindow, start: np.ndarray, end: np.ndarray, null_score: float, k: int, max_answer_len: int, handle_impossible: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """One window's best ``k`` (start, end, score), and the lowest "no answer" score so far; in float32 with the
    pipeline's own operations, so that equal logits give equal scores and equal ties."""
    n = w.length
    start, end = np.asarray(start, dtype=np.float32), np.asarray(end, dtype=np.float32)
    if start.shape[-1] < n or end.shape[-1] < n:
        raise ValueError(f"a window of {n} tokens with {start.shape[-1]} start and {end.shape[-1]} end logits")
    allowed = w.span_mask.astype(np.int64)[None]  # (1, n)
    masked = allowed == 0
    p_start = _softmax(np.where(masked, _MASKED, start[None, :n]))  # (1, n)
    p_end = _softmax(np.where(masked, _MASKED, end[None, :n]))
    if handle_impossible:
        null_score = min(null_score, (p_start[0, 0] * p_end[0, 0]).item())
    p_start[0, 0] = p_end[0, 0] = 0.0
    outer = np.matmul(np.expand_dims(p_start, -1), np.expand_dims(p_end, 1))  # (1, n, n): start x end
    spans = np.tril(np.triu(outer), max_answer_len - 1)  # end >= start, end < start + max_answer_len
    flat = spans.flatten()
    if k == 1:
        order = np.asarray([np.argmax(flat)])
    elif len(flat) < k:
        order = np.argsort(-flat)
    else:
        top = np.argpartition(-flat, k)[0:k]
        order = top[np.argsort(-flat[top])]
    starts, ends = np.unravel_index(order, spans.shape)[1:]
    # membership in nonzero() of the (1, n) mask, as the pipeline tests it: its row indices (0) admit position 0 too
    keep = np.isin(starts, allowed.nonzero()) & np.isin(ends, allowed.nonzero())
    starts, ends = starts[keep], ends[keep]
    return starts, ends, spans[0, starts, ends], null_score


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum()


def _chars(w: QAWindow, s: int, e: int, align_to_words: bool) -> tuple[int, int]:
    """Characters of the context for the span of tokens s..e: widened to the words they fall in by default; the
    tokens' own offsets where a token has no word ([CLS]) or with ``align_to_words`` off."""
    if align_to_words and w.word_spans[s, 0] >= 0 and w.word_spans[e, 0] >= 0:
        return int(w.word_spans[s, 0]), int(w.word_spans[e, 1])
    return int(w.offsets[s, 0]), int(w.offsets[e, 1])
