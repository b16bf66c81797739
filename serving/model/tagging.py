"""Token classification (tagging: NER, POS) from one row's per-token logits to answers: the word-piece list and the
five aggregation strategies, decided as ``transformers.pipeline("token-classification")`` decides them, so that the
same logits give the same entities, words, scores and character offsets. numpy and ``tokenizers`` only.

How the pipeline decides (transformers 4.57), and so how this module does:
- a token's score is the softmax of its logits (float32); special tokens ([CLS], [SEP], padding) are skipped;
- a word piece continues the word before it when the tokenizer's model marks continuations (WordPiece's ``##``, a
  BPE with a ``continuing_subword_prefix``) and the token's text is not as long as the characters it covers;
  otherwise (byte-level BPE, Unigram) when the character before it is not a space: a heuristic, as in the pipeline;
  an unknown token ([UNK]) is never a continuation and its word is the text it covers;
- "first" / "max" / "average" first give each word one label (its first piece's, its most confident piece's, the
  argmax of its pieces' mean probabilities), then adjacent words are grouped as "simple" groups tokens: a piece
  labelled ``B-X`` starts a new group, ``I-X`` (or a bare ``X``) after a group of type X joins it;
- a group's score is the mean of its members' scores, its word the tokenizer's decoding of the members' words;
- tokens or groups whose label is in ``ignore_labels`` (default ``["O"]``, the pipeline's) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tokenizers.decoders import Decoder

from fusionserve.errors import InputError

AGGREGATIONS = ("none", "simple", "first", "average", "max")
IGNORE_LABELS = ("O",)  # the pipeline's default ignore_labels
SCORE_DIGITS = 6  # probabilities are rounded as label_scores rounds them; logits (raw_scores) are not


@dataclass
class _Piece:
    """One word piece of the row (special tokens excluded)."""

    word: str  # the token's text (the vocabulary's), or for an unknown token the characters it covers
    probs: np.ndarray  # (n_labels,) float32
    logits: np.ndarray  # (n_labels,) float32
    start: int
    end: int
    index: int  # position in the row, [CLS] = 0
    is_subword: bool


def check_aggregation(aggregation: str, raw_scores: bool = False) -> None:
    """Raise InputError for an aggregation strategy that is not one of AGGREGATIONS, or for ``raw_scores`` with an
    aggregation (each token's logits are given per word piece only)."""
    if aggregation not in AGGREGATIONS:
        raise InputError(f"aggregation_strategy {aggregation!r:.40} is not known; allowed: {', '.join(AGGREGATIONS)}")
    if raw_scores and aggregation != "none":
        raise InputError(f"raw_scores gives each word piece's logits: it needs aggregation_strategy 'none', got {aggregation!r}")


def tag(
    tokenizer: Tokenizer,
    text: str,
    labels: Sequence[str],
    logits: np.ndarray,
    ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    special: Sequence[bool],
    aggregation: str = "none",
    raw_scores: bool = False,
    ignore_labels: Sequence[str] = IGNORE_LABELS,
) -> dict[str, list[dict[str, Any]]]:
    """One row's answer: ``{"tokens": [...]}`` (aggregation "none": ``entity, score, index, word, start, end`` per
    word piece, with ``raw_scores`` also ``scores``: {label: logit}) or ``{"entities": [...]}`` (``entity_group,
    score, word, start, end``), as the token-classification pipeline answers for the same logits.

    ``ids``, ``offsets`` (character offsets into ``text``) and ``special`` are the row's tokens as the tokenizer
    encoded ``text`` (special tokens included, padding excluded); ``logits`` (n_tokens, >= n_labels) the tagging
    head's output for them (rows and columns past those are padding and ignored). Raises InputError for an unknown
    strategy or raw_scores with one, ValueError when the arrays do not fit together."""
    check_aggregation(aggregation, raw_scores)
    pieces = _pieces(tokenizer, text, labels, logits, ids, offsets, special)
    ignored = set(ignore_labels)
    if aggregation == "none":
        tokens = [_token(p, labels) for p in pieces]
        if raw_scores:
            for t, p in zip(tokens, pieces, strict=True):
                t["scores"] = {lab: float(v) for lab, v in zip(labels, p.logits, strict=True)}
        return {"tokens": [_rounded(t) for t in tokens if t["entity"] not in ignored]}
    decoder = tokenizer.decoder  # once: each access builds a new wrapper
    entities = [_token(p, labels) for p in pieces] if aggregation == "simple" else _words(decoder, pieces, labels, aggregation)
    groups = [_group(decoder, g) for g in _adjacent(entities)]
    return {"entities": [_rounded(g) for g in groups if g["entity_group"] not in ignored]}


def _pieces(
    tokenizer: Tokenizer,
    text: str,
    labels: Sequence[str],
    logits: np.ndarray,
    ids: Sequence[int],
    offsets: Sequence[tuple[int, int]],
    special: Sequence[bool],
) -> list[_Piece]:
    n = len(ids)
    raw = np.asarray(logits, dtype=np.float32)
    if raw.ndim != 2 or raw.shape[0] < n or raw.shape[1] < len(labels) or len(offsets) != n or len(special) != n:
        raise ValueError(
            f"tagging logits of shape {raw.shape} for {n} tokens ({len(offsets)} offsets, {len(special)} special flags) "
            f"and {len(labels)} labels: expected (>= {n}, >= {len(labels)}) and one offset and flag per token"
        )
    raw = raw[:n, : len(labels)]  # (n_tokens, n_labels)
    shifted = np.exp(raw - np.max(raw, axis=-1, keepdims=True))  # float32, as the pipeline computes it
    probs = shifted / shifted.sum(axis=-1, keepdims=True)
    marks_words = bool(getattr(tokenizer.model, "continuing_subword_prefix", None))
    unk = _unk_id(tokenizer)
    out = []
    for i in range(n):
        if special[i]:
            continue
        start, end = int(offsets[i][0]), int(offsets[i][1])
        word = tokenizer.id_to_token(int(ids[i])) or ""
        covered = text[start:end]
        # a vocabulary that marks continuations: the token is shorter or longer than its text (it carries "##");
        # one that does not: the pipeline's fallback heuristic, the character before is not a space
        is_subword = len(word) != len(covered) if marks_words else start > 0 and " " not in text[start - 1 : start + 1]
        if int(ids[i]) == unk:
            word, is_subword = covered, False
        out.append(_Piece(word, probs[i], raw[i], start, end, i, is_subword))
    return out


def _unk_id(tokenizer: Tokenizer) -> int | None:
    """The unknown token's id: the model's (WordPiece, BPE), else the usual names' ([UNK], <unk>)."""
    names = [getattr(tokenizer.model, "unk_token", None), "[UNK]", "<unk>"]
    for name in names:
        if name:
            found = tokenizer.token_to_id(name)
            if found is not None:
                return int(found)
    return None


def _token(p: _Piece, labels: Sequence[str]) -> dict[str, Any]:
    best = int(p.probs.argmax())
    return {"entity": labels[best], "score": p.probs[best], "index": p.index, "word": p.word, "start": p.start, "end": p.end}


def _decode(decoder: Decoder | None, words: list[str]) -> str:
    """What the pipeline's ``convert_tokens_to_string`` gives: the tokenizer's decoder, else the words joined by spaces."""
    return decoder.decode(words) if decoder is not None else " ".join(words)


def _words(decoder: Decoder | None, pieces: list[_Piece], labels: Sequence[str], aggregation: str) -> list[dict[str, Any]]:
    """One entity per word: a piece that is not a continuation starts a word."""
    words: list[list[_Piece]] = []
    for p in pieces:
        if words and p.is_subword:
            words[-1].append(p)
        else:
            words.append([p])
    return [_word(decoder, w, labels, aggregation) for w in words]


def _word(decoder: Decoder | None, pieces: list[_Piece], labels: Sequence[str], aggregation: str) -> dict[str, Any]:
    if aggregation == "first":
        probs = pieces[0].probs
    elif aggregation == "max":
        probs = max(pieces, key=lambda p: p.probs.max()).probs  # the first of equally confident pieces
    elif len(pieces) == 1:  # "average" of one piece: itself (what nanmean gives, bit for bit, at a fraction of its cost)
        probs = pieces[0].probs
    else:  # "average": the mean of the pieces' probabilities
        probs = np.nanmean(np.stack([p.probs for p in pieces]), axis=0)
    best = int(probs.argmax())
    word = _decode(decoder, [p.word for p in pieces])
    return {"entity": labels[best], "score": probs[best], "word": word, "start": pieces[0].start, "end": pieces[-1].end}


def _bio(label: str) -> tuple[str, str]:
    """(B or I, type): ``B-X`` begins an entity of type X, ``I-X`` continues one; a label without a prefix continues."""
    if label.startswith("B-"):
        return "B", label[2:]
    if label.startswith("I-"):
        return "I", label[2:]
    return "I", label


def _adjacent(entities: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Runs of adjacent entities of one type, a ``B-`` label starting a new run."""
    runs: list[list[dict[str, Any]]] = []
    for e in entities:
        bi, kind = _bio(e["entity"])
        if runs and bi != "B" and kind == _bio(runs[-1][-1]["entity"])[1]:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def _group(decoder: Decoder | None, run: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "entity_group": run[0]["entity"].split("-", 1)[-1],
        "score": _mean([e["score"] for e in run]),
        "word": _decode(decoder, [e["word"] for e in run]),
        "start": run[0]["start"],
        "end": run[-1]["end"],
    }


def _mean(scores: list[np.float32]) -> np.float32:
    """The pipeline's mean of a group's scores (nanmean in float32); one score is its own mean, bit for bit."""
    return scores[0] if len(scores) == 1 else np.mean(np.nanmean(scores))


def _rounded(entry: dict[str, Any]) -> dict[str, Any]:
    entry["score"] = round(float(entry["score"]), SCORE_DIGITS)
    return entry
