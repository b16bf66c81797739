"""Read the prediction heads AdapterHub's ``save_head`` writes: ``head_config.json`` + ``model_head.safetensors`` (or
``pytorch_model_head.bin``, read with ``weights_only=True``), for every head kind it trains on these encoders.

Each kind is built by AdapterHub (adapters 1.3.0, ``heads/base.py``) as the same stack: at inference (dropout off)
``layers - 1`` times Linear(H, H) -> activation, then Linear(H, out). What differs is what it reads and ``out``:

- ``classification``: the [CLS] state (or the pooler's output with ``use_pooler``), out = num_labels >= 2;
- ``regression``: a ``classification`` head with num_labels 1 (AdapterHub trains it with MSE: the logit is the value);
- ``multiple_choice``: like classification with out = 1, one logit per (context, choice) pair; ``num_choices`` is the
  count it was trained with (AdapterHub reshapes its logits to (batch, num_choices); we score each pair as a row);
- ``tagging``: every token's final hidden state, out = num_labels;
- ``question_answering``: every token's final hidden state, out = 2 (start, end).

A config field the kind's head class does not take, a head kind not listed here, or weights that do not fit raise
CheckpointError naming the file, the field and the value."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionserve.errors import CheckpointError
from fusionserve.serving.model.artifact import TOKEN_HEADS
from fusionserve.serving.model.heads import CLASSIFICATION, MULTIPLE_CHOICE, QUESTION_ANSWERING, REGRESSION, TAGGING

from .nonlinearity import ACTIVATIONS
from .weights import check_shape, hidden_size, model_type, read_config, read_weights

_COMMON = {"head_type", "layers", "activation_function", "label2id", "dropout_prob"}
# AdapterHub's head_type -> the config fields its head class takes (its constructor's parameters, as saved)
_FIELDS = {
    CLASSIFICATION: _COMMON | {"num_labels", "use_pooler", "bias"},
    MULTIPLE_CHOICE: _COMMON | {"num_choices", "use_pooler"},
    TAGGING: _COMMON | {"num_labels"},
    QUESTION_ANSWERING: _COMMON | {"num_labels"},
}
_DEFAULT_LAYERS = {CLASSIFICATION: 2, MULTIPLE_CHOICE: 2, TAGGING: 1, QUESTION_ANSWERING: 1}  # the constructors' defaults
_HEAD_KEY = re.compile(r"^heads\.(.+)\.(\d+)\.(weight|bias)$")
# Labels of one head. The graph pads every task's logits to the widest head's labels, so one wide head costs every
# row of every task: a head of 10^6 labels took 45 s and 4.7 GB to export. Classification heads have tens to
# thousands of labels; 100,000 is far past them.
MAX_LABELS = 100_000
# What the manifest calls the outputs of the heads without label names: the value of a regression head, the one logit
# of a multiple-choice row, the two of a question-answering token
FIXED_LABELS = {REGRESSION: ("score",), MULTIPLE_CHOICE: ("choice",), QUESTION_ANSWERING: ("start", "end")}


@dataclass(frozen=True)
class HeadCheckpoint:
    name: str
    folder: Path
    hidden_size: int
    labels: tuple[str, ...]  # in output order: label2id's names, or FIXED_LABELS of the kind
    linears: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]  # (weight (out, in), bias)
    activation: str | None
    use_pooler: bool
    model_type: str | None = None
    kind: str = CLASSIFICATION  # classification | regression | multiple_choice | tagging | question_answering
    num_choices: int | None = None  # multiple choice: the count AdapterHub trained with (information, not a limit)

    @property
    def level(self) -> str:
        """ "token" for a head over every token's final state (tagging, question answering), else "sequence"."""
        return "token" if self.kind in TOKEN_HEADS else "sequence"


def load_head(folder: Path) -> HeadCheckpoint:
    """Read a ``save_head`` folder holding a head of any kind AdapterHub trains on these encoders (see the module
    docstring); raises CheckpointError naming the file, the field and the value otherwise."""
    data = read_config(folder, "head_config.json")
    cfg_path = folder / "head_config.json"
    cfg = data["config"]
    head_type = cfg.get("head_type")
    if head_type not in _FIELDS:
        raise CheckpointError(
            f"{cfg_path}: field 'config.head_type' = {head_type!r} is not supported; supported: {', '.join(_FIELDS)}"
        )
    unknown = set(cfg) - _FIELDS[head_type]
    if unknown:
        raise CheckpointError(
            f"{cfg_path}: unknown config field(s) {sorted(unknown)} for a {head_type} head; refusing to guess what they do"
        )
    hidden = hidden_size(data, cfg_path)
    n_layers = cfg.get("layers", _DEFAULT_LAYERS[head_type])
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise CheckpointError(f"{cfg_path}: field 'config.layers' = {n_layers!r} must be an integer >= 1")
    act = cfg.get("activation_function")
    act = str(act).lower() if act else None
    if act is not None and act not in ACTIVATIONS:
        raise CheckpointError(
            f"{cfg_path}: field 'config.activation_function' = {act!r} is not supported; allowed: {', '.join(ACTIVATIONS)}"
        )
    kind, labels, choices = _kind_and_labels(head_type, cfg, cfg_path)
    linears = _linears(folder, data.get("name"), n_layers, hidden, len(labels), bool(cfg.get("bias", True)))
    return HeadCheckpoint(
        name=str(data.get("name") or folder.name), folder=folder, hidden_size=hidden, labels=labels,
        linears=linears, activation=act, use_pooler=bool(cfg.get("use_pooler", False)), model_type=model_type(data),
        kind=kind, num_choices=choices,
    )  # fmt: skip


def _kind_and_labels(head_type: str, cfg: dict[str, Any], cfg_path: Path) -> tuple[str, tuple[str, ...], int | None]:
    """(kind, output names, num_choices) of a head config of a supported ``head_type``; raises CheckpointError."""
    if head_type == MULTIPLE_CHOICE:
        choices = cfg.get("num_choices")
        if not isinstance(choices, int) or isinstance(choices, bool) or choices < 2:
            raise CheckpointError(f"{cfg_path}: field 'config.num_choices' = {choices!r} must be an integer >= 2")
        # label2id names the trained choice positions (LABEL_0 ..): the answer names the chosen choice's text instead
        return MULTIPLE_CHOICE, FIXED_LABELS[MULTIPLE_CHOICE], choices
    n_labels = cfg.get("num_labels")
    _check_num_labels(n_labels, cfg_path)
    if head_type == QUESTION_ANSWERING:
        if n_labels != 2:  # AdapterHub splits the output into start and end logits
            raise CheckpointError(
                f"{cfg_path}: field 'config.num_labels' = {n_labels!r}: a question_answering head has 2 (start, end)"
            )
        return QUESTION_ANSWERING, FIXED_LABELS[QUESTION_ANSWERING], None
    labels = _labels(cfg.get("label2id"), n_labels, cfg_path)
    if head_type == CLASSIFICATION and n_labels == 1:
        return REGRESSION, FIXED_LABELS[REGRESSION], None
    return head_type, labels, None


def _linears(
    folder: Path, name: Any, n_layers: int, hidden: int, n_out: int, bias: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
    """The head's linear layers (weight (out, in), bias) in order; raises CheckpointError for weights that do not fit."""
    weights = read_weights(folder, "model_head.safetensors", "pytorch_model_head.bin")
    by_index: dict[int, dict[str, torch.Tensor]] = {}
    others: set[str] = set()
    for key, tensor in weights.items():
        m = _HEAD_KEY.match(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for a prediction head")
        if name is not None and m.group(1) != name:
            # AdapterHub's save_head matches head names by prefix: saving "rte" also writes "rte_2"'s weights
            others.add(m.group(1))
            continue
        by_index.setdefault(int(m.group(2)), {})[m.group(3)] = tensor
    if not by_index and others:
        raise CheckpointError(f"{folder}: no weights for head '{name}' (the file holds heads {sorted(others)})")
    if len(by_index) != n_layers:
        raise CheckpointError(f"{folder}: config says {n_layers} linear layer(s), weights hold {len(by_index)}")
    linears = []
    for i, idx in enumerate(sorted(by_index)):
        out = n_out if i == n_layers - 1 else hidden
        got = by_index[idx]
        if "weight" not in got:
            raise CheckpointError(f"{folder}: missing weight for head module {idx}: weight")
        if bias and "bias" not in got:
            raise CheckpointError(f"{folder}: missing weight for head module {idx}: bias")
        w = check_shape(got["weight"], (out, hidden), f"heads.{idx}.weight", folder)
        b = check_shape(got["bias"], (out,), f"heads.{idx}.bias", folder) if "bias" in got else None
        linears.append((w, b))
    return tuple(linears)


def _check_num_labels(n_labels: Any, cfg_path: Path) -> None:
    """Raises CheckpointError unless ``n_labels`` is a whole number from 1 to MAX_LABELS."""
    if not isinstance(n_labels, int) or isinstance(n_labels, bool) or n_labels < 1:
        raise CheckpointError(f"{cfg_path}: field 'config.num_labels' = {n_labels!r} must be an integer >= 1")
    if n_labels > MAX_LABELS:
        raise CheckpointError(
            f"{cfg_path}: field 'config.num_labels' = {n_labels:,} is over the limit of {MAX_LABELS:,} labels per head "
            f"(every task's logits are padded to the widest head: {n_labels:,} labels cost {4 * n_labels:,} bytes per "
            "row of every task, and the head's weights hidden x labels)"
        )


def _labels(label2id: Any, n_labels: int, path: Path) -> tuple[str, ...]:
    if label2id is None:
        return tuple(f"LABEL_{i}" for i in range(n_labels))
    if not isinstance(label2id, dict):
        raise CheckpointError(f"{path}: field 'config.label2id' must map labels to ids, got {type(label2id).__name__}")
    ids = sorted(label2id.values()) if all(type(v) is int for v in label2id.values()) else None
    if ids != list(range(n_labels)):
        raise CheckpointError(
            f"{path}: field 'config.label2id' = {label2id!r} must give each of the {n_labels} label ids 0..{n_labels - 1} once"
        )
    by_id = {v: str(k) for k, v in label2id.items()}
    return tuple(by_id[i] for i in range(n_labels))
