"""Each head kind's usual evaluation metric, as its reference tool computes it: accuracy (classification, multiple
choice), Pearson and Spearman correlation (regression; ties ranked as scipy ranks them), entity-level precision,
recall and F1 (tagging; seqeval's default mode, which is conlleval's), SQuAD v1.1 exact match and F1 (extractive QA).

Every score is a fraction (accuracy and F1 in 0..1, correlations in -1..1), not a percentage. numpy only.
Each function raises ValueError when gold and predictions do not pair up (both counts in the message).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

Values = Sequence[float] | np.ndarray  # a list of numbers or a 1-D array


def _paired(gold: Sequence | np.ndarray, pred: Sequence | np.ndarray, what: str, least: int = 1) -> None:
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold {what} and {len(pred)} predictions: they must pair up one to one")
    if len(gold) < least:
        raise ValueError(f"{len(gold)} {what}: at least {least} needed")


def accuracy(gold: Sequence[Hashable], pred: Sequence[Hashable]) -> float:
    """The fraction of predictions equal to their gold label (labels, or choice indices for multiple choice)."""
    _paired(gold, pred, "labels")
    return sum(g == p for g, p in zip(gold, pred, strict=True)) / len(gold)


# --- regression ------------------------------------------------------------------------------------------------


def pearson(gold: Values, pred: Values) -> float:
    """Pearson's r; NaN where it is undefined (a constant series or a NaN value), as scipy.stats.pearsonr gives."""
    _paired(gold, pred, "values", least=2)
    x, y = np.asarray(gold, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    scale = np.sqrt(float(dx @ dx) * float(dy @ dy))
    if scale == 0.0:
        return float("nan")
    return float(np.clip((dx @ dy) / scale, -1.0, 1.0))


def rank(values: Values) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (scipy.stats.rankdata's "average")."""
    x = np.asarray(values, dtype=np.float64)
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]  # (n,) True where a new value begins
    group = np.cumsum(starts) - 1  # (n,) tie group of each sorted position
    bounds = np.r_[np.flatnonzero(starts), len(x)]  # group g spans sorted positions bounds[g] .. bounds[g + 1] - 1
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = (bounds[group] + bounds[group + 1] + 1) / 2.0
    return ranks


def spearman(gold: Values, pred: Values) -> float:
    """Spearman's rho: Pearson's r of the ranks (ties averaged); NaN where undefined, as scipy.stats.spearmanr."""
    _paired(gold, pred, "values", least=2)
    x, y = np.asarray(gold, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    if np.isnan(x).any() or np.isnan(y).any():
        return float("nan")
    return pearson(rank(x), rank(y))


# --- tagging: entities the conlleval way ------------------------------------------------------------------------


def _split(tag: str) -> tuple[str, str]:
    """(prefix letter, type) as seqeval reads a tag: "B-PER" -> (B, PER); "O" -> (O, _). Raises ValueError for an
    empty tag or one that is not a string."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"{tag!r} is not a tag (expected strings such as 'O', 'B-PER', 'I-PER')")
    return tag[0], tag[1:].split("-", 1)[-1] or "_"


def _ends(prev: str, cur: str, prev_type: str, cur_type: str) -> bool:
    """An entity ends between the previous tag and this one (conlleval's rules, IOB1/IOB2/IOE/IOBES prefixes)."""
    if prev in ("E", "S") or (prev in ("B", "I") and cur in ("B", "S", "O")):
        return True
    return prev not in ("O", ".") and prev_type != cur_type


def _starts(prev: str, cur: str, prev_type: str, cur_type: str) -> bool:
    """An entity starts at this tag: B or S, an I or E with no entity open before it, or a change of type."""
    if cur in ("B", "S") or (prev in ("E", "S", "O") and cur in ("E", "I")):
        return True
    return cur not in ("O", ".") and prev_type != cur_type


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) of each entity in one sequence of tags, as seqeval's get_entities reads them (lenient:
    an I- tag after O opens an entity)."""
    found = []
    prev, prev_type, begin = "O", "", 0
    for i, tag in enumerate([*tags, "O"]):
        cur, cur_type = _split(tag)
        if _ends(prev, cur, prev_type, cur_type):
            found.append((prev_type, begin, i - 1))
        if _starts(prev, cur, prev_type, cur_type):
            begin = i
        prev, prev_type = cur, cur_type
    return found


def _prf(correct: int, predicted: int, true: int) -> dict[str, float]:
    precision = correct / predicted if predicted else 0.0  # seqeval's zero_division default: 0
    recall = correct / true if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def entity_f1(gold_tags: Sequence[Sequence[str]], pred_tags: Sequence[Sequence[str]]) -> dict:
    """Entity-level micro precision, recall and F1 over sentences of BIO/IOB2 tags (an entity counts when its type,
    first and last token all match), as ``seqeval.metrics`` computes them by default; ``per_type`` gives each entity
    type's precision, recall, f1 and support (its gold entities). With no predicted (gold) entity, precision
    (recall) is 0, as seqeval's default gives. Raises ValueError when sentences or their lengths differ."""
    _paired(gold_tags, pred_tags, "sentences")
    gold: set[tuple[str, int, int]] = set()
    pred: set[tuple[str, int, int]] = set()
    offset = 0
    for i, (g, p) in enumerate(zip(gold_tags, pred_tags, strict=True)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags and {len(p)} predicted tags")
        gold |= {(t, a + offset, b + offset) for t, a, b in entities(list(g))}
        pred |= {(t, a + offset, b + offset) for t, a, b in entities(list(p))}
        offset += len(g)  # positions unique over the sentences; each sentence is read on its own, no entity spans two
    per_type = {}
    for kind in sorted({e[0] for e in gold | pred}):
        g_k, p_k = {e for e in gold if e[0] == kind}, {e for e in pred if e[0] == kind}
        per_type[kind] = {**_prf(len(g_k & p_k), len(p_k), len(g_k)), "support": len(g_k)}
    return {**_prf(len(gold & pred), len(pred), len(gold)), "per_type": per_type}


# --- extractive QA: the SQuAD v1.1 evaluation script's rules ----------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lower case, punctuation removed, the articles a/an/the removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(pred: str, gold: str) -> float:
    """Token overlap F1 of two normalized answers (v1.1: 0 when they share no token, both empty included)."""
    p, g = pred.split(), gold.split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad(gold_answers: Sequence[Sequence[str]], predictions: Sequence[str]) -> dict[str, float]:
    """SQuAD v1.1 exact match and F1, each the mean over questions of the best over that question's acceptable
    answers, as fractions (the script prints them x 100). A question with no acceptable answer (an empty list) is
    unanswerable (SQuAD 2.0's convention): it scores 1 for an empty prediction, else 0."""
    _paired(gold_answers, predictions, "questions")
    exact = f1 = 0.0
    for answers, prediction in zip(gold_answers, predictions, strict=True):
        if isinstance(answers, str):
            raise ValueError(f"gold answers must be a list of acceptable answers per question, got the string {answers!r:.60}")
        pred = normalize_answer(prediction)
        if not answers:
            exact += pred == ""
            f1 += pred == ""
            continue
        golds = [normalize_answer(a) for a in answers]
        exact += max(float(pred == g) for g in golds)
        f1 += max(_f1(pred, g) for g in golds)
    return {"exact_match": exact / len(predictions), "f1": f1 / len(predictions)}
