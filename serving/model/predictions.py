"""Inputs and outputs of a call, shared by every runner (PyTorch from a spec, ONNX Runtime from an artifact), the
server, scoring and the CLI: a text or a pair (classification, regression, tagging), a context with its choices
(multiple choice), a question with its context (extractive question answering). No torch here: numpy only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionserve.errors import InputError

from ..options import MAX_CHOICES, MIN_CHOICES, meaningful


@dataclass(frozen=True)
class TextInput:
    """One text to classify, or a pair (encoded as a pair: [CLS] text [SEP] text_pair [SEP])."""

    text: str
    text_pair: str | None = None
    id: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not meaningful(self.text):
            raise InputError(f"'text' must be a non-empty string, got {self.text!r:.80}")
        if self.text_pair is not None and (not isinstance(self.text_pair, str) or not meaningful(self.text_pair)):
            raise InputError(f"'text_pair' must be a non-empty string or absent, got {self.text_pair!r:.80}")

    @classmethod
    def from_json(cls, obj: Any) -> TextInput:
        """From ``{"text": ..., "text_pair": ..., "id": ...}``; raises InputError naming the problem."""
        if not isinstance(obj, dict):
            raise InputError(f'expected an object like {{"text": "..."}}, got {type(obj).__name__}')
        unknown = set(obj) - {"text", "text_pair", "id"}
        if unknown:
            raise InputError(f"unknown field(s) {sorted(unknown)}; allowed: text, text_pair, id")
        if "text" not in obj:
            raise InputError("missing field 'text'")
        return cls(obj["text"], obj.get("text_pair"), obj.get("id"))


def _text(value: Any, field: str) -> str:
    """``value`` when it is a string holding something the tokenizer keeps; raises InputError naming ``field``."""
    if not isinstance(value, str) or not meaningful(value):
        raise InputError(f"'{field}' must be a non-empty string, got {value!r:.80}")
    return value


@dataclass(frozen=True)
class ChoiceInput:
    """A multiple-choice input: a context and MIN_CHOICES..MAX_CHOICES choices; choice j is run as the pair
    [CLS] text [SEP] choices[j] [SEP], and the choices' logits are softmaxed across the choices."""

    text: str
    choices: tuple[str, ...]
    id: Any = None

    def __post_init__(self) -> None:
        _text(self.text, "text")
        if not isinstance(self.choices, (tuple, list)):
            raise InputError(f"'choices' must be a list of {MIN_CHOICES} to {MAX_CHOICES} texts, got {self.choices!r:.80}")
        n = len(self.choices)
        if not MIN_CHOICES <= n <= MAX_CHOICES:
            raise InputError(
                f"'choices' holds {n} choice{'s' if n != 1 else ''}; a multiple-choice input needs {MIN_CHOICES} to {MAX_CHOICES}"
            )
        for j, choice in enumerate(self.choices):
            _text(choice, f"choices[{j}]")
        object.__setattr__(self, "choices", tuple(self.choices))


@dataclass(frozen=True)
class QAInput:
    """An extractive question-answering input: the answer is a span of ``context``, read in overlapping windows of the
    pair [CLS] question [SEP] context [SEP] when it is longer than the model's token limit."""

    question: str
    context: str
    id: Any = None

    def __post_init__(self) -> None:
        _text(self.question, "question")
        _text(self.context, "context")


Input = TextInput | ChoiceInput | QAInput
SHAPES = {TextInput: "a text or a pair", ChoiceInput: "a context with choices", QAInput: "a question with its context"}


def read_input(obj: Any) -> Input:
    """An input from its JSON form: ``{"text", "text_pair"?}``, ``{"text", "choices"}`` or ``{"question", "context"}``,
    each with an optional ``"id"``. Raises InputError naming the field and what is allowed."""
    if not isinstance(obj, dict):
        return TextInput.from_json(obj)
    if "choices" in obj:
        _only(obj, ("text", "choices", "id"), "a multiple-choice input")
        if "text" not in obj:
            raise InputError("missing field 'text' (the context the choices continue or answer)")
        return ChoiceInput(obj["text"], obj["choices"], obj.get("id"))
    if "question" in obj or "context" in obj:
        _only(obj, ("question", "context", "id"), "a question-answering input")
        for field in ("question", "context"):
            if field not in obj:
                raise InputError(f'missing field \'{field}\': a question-answering input is {{"question": ..., "context": ...}}')
        return QAInput(obj["question"], obj["context"], obj.get("id"))
    return TextInput.from_json(obj)


def _only(obj: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = set(obj) - set(allowed)
    if unknown:
        raise InputError(f"unknown field(s) {sorted(unknown)} for {what}; allowed: {', '.join(allowed)}")


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def label_scores(labels: Sequence[str], logits: np.ndarray) -> list[tuple[str, float, dict[str, float]]]:
    """Per row: the winning label, its probability, and every label's probability (rounded to 6 digits)."""
    out = []
    for p in softmax(np.asarray(logits, dtype=np.float64)):
        best = int(np.argmax(p))
        out.append((labels[best], round(float(p[best]), 6), {lab: round(float(v), 6) for lab, v in zip(labels, p, strict=True)}))
    return out


def label_logits(labels: Sequence[str], logits: np.ndarray) -> list[tuple[str, float, dict[str, float]]]:
    """Per row: the winning label, its logit, and every label's logit, unrounded (``raw_scores``): what
    ``label_scores`` gives, before the softmax."""
    out = []
    for row in np.asarray(logits, dtype=np.float64):
        best = int(np.argmax(row))
        out.append((labels[best], float(row[best]), {lab: float(v) for lab, v in zip(labels, row, strict=True)}))
    return out


def choice_scores(choices: Sequence[str], logits: np.ndarray, raw_scores: bool = False) -> dict[str, Any]:
    """One multiple-choice input's prediction from its rows' logits, one per choice (shape (k,) or (k, 1)):
    ``{"label": the chosen choice's text, "choice": its index, "scores": [one per choice]}``, the scores a softmax
    over the choices rounded to 6 digits, or with ``raw_scores`` the logits unrounded. The first of equal best wins.
    Raises ValueError when the logits are not one per choice."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if row.shape[0] != len(choices) or not len(choices):
        raise ValueError(f"{row.shape[0]} logits for {len(choices)} choices: expected one per choice")
    best = int(np.argmax(row))
    scores = [float(v) for v in row] if raw_scores else [round(float(v), 6) for v in softmax(row)]
    return {"label": choices[best], "choice": best, "scores": scores}
