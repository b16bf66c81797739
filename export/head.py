"""Read the classification heads AdapterHub's ``save_head`` writes: ``head_config.json`` + ``model_head.safetensors``
(or ``pytorch_model_head.bin``, read with ``weights_only=True``). Anything but a classification head raises
CheckpointError naming the file, the field and the value."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusionserve.errors import CheckpointError

from .nonlinearity import ACTIVATIONS
from .weights import check_shape, hidden_size, model_type, read_config, read_weights

_HEAD_KNOWN = {"head_type", "num_labels", "layers", "activation_function", "label2id", "use_pooler", "bias", "dropout_prob"}
_HEAD_KEY = re.compile(r"^heads\.(.+)\.(\d+)\.(weight|bias)$")
# Labels of one head. The graph pads every task's logits to the widest head's labels, so one wide head costs every
# row of every task: a head of 10^6 labels took 45 s and 4.7 GB to export. Classification heads have tens to
# thousands of labels; 100,000 is far past them.
MAX_LABELS = 100_000


@dataclass(frozen=True)
class HeadCheckpoint:
    name: str
    folder: Path
    hidden_size: int
    labels: tuple[str, ...]  # in label-id order
    linears: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]  # (weight (out, in), bias)
    activation: str | None
    use_pooler: bool
    model_type: str | None = None


def load_head(folder: Path) -> HeadCheckpoint:
    """Read a ``save_head`` folder holding a classification head; raises CheckpointError otherwise."""
    data = read_config(folder, "head_config.json")
    cfg_path = folder / "head_config.json"
    cfg = data["config"]
    if cfg.get("head_type") != "classification":
        raise CheckpointError(
            f"{cfg_path}: field 'config.head_type' = {cfg.get('head_type')!r} is not supported; only 'classification'"
        )
    unknown = set(cfg) - _HEAD_KNOWN
    if unknown:
        raise CheckpointError(f"{cfg_path}: unknown config field(s) {sorted(unknown)}; refusing to guess what they do")
    hidden = hidden_size(data, cfg_path)
    n_layers, n_labels = cfg.get("layers", 2), cfg.get("num_labels")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise CheckpointError(f"{cfg_path}: field 'config.layers' = {n_layers!r} must be an integer >= 1")
    _check_num_labels(n_labels, cfg_path)
    act = cfg.get("activation_function")
    act = str(act).lower() if act else None
    if act is not None and act not in ACTIVATIONS:
        raise CheckpointError(
            f"{cfg_path}: field 'config.activation_function' = {act!r} is not supported; allowed: {', '.join(ACTIVATIONS)}"
        )
    labels = _labels(cfg.get("label2id"), n_labels, cfg_path)

    weights = read_weights(folder, "model_head.safetensors", "pytorch_model_head.bin")
    name = data.get("name")
    by_index: dict[int, dict[str, torch.Tensor]] = {}
    others: set[str] = set()
    for key, tensor in weights.items():
        m = _HEAD_KEY.match(key)
        if m is None:
            raise CheckpointError(f"{folder}: unexpected weight '{key}' for a classification head")
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
        out = n_labels if i == n_layers - 1 else hidden
        got = by_index[idx]
        if "weight" not in got:
            raise CheckpointError(f"{folder}: missing weight for head module {idx}: weight")
        if cfg.get("bias", True) and "bias" not in got:
            raise CheckpointError(f"{folder}: missing weight for head module {idx}: bias")
        w = check_shape(got["weight"], (out, hidden), f"heads.{idx}.weight", folder)
        b = check_shape(got["bias"], (out,), f"heads.{idx}.bias", folder) if "bias" in got else None
        linears.append((w, b))
    return HeadCheckpoint(
        name=str(data.get("name") or folder.name), folder=folder, hidden_size=hidden, labels=labels,
        linears=tuple(linears), activation=act, use_pooler=bool(cfg.get("use_pooler", False)), model_type=model_type(data),
    )  # fmt: skip


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
