"""The inputs int8 is calibrated on: the texts of ``--calibration FILE`` (JSONL, one ``{"text": ..., "text_pair": ...}``
object a line, as ``fusionserve predict --input`` reads), tokenized as serving does, or without a file the export's
validation grid (random token ids, padded rows; what the int8 gate runs). Smoothing (``smooth.py``) takes each GEMM
input's largest magnitude per channel from them; static quantization takes its activation ranges from them.

A calibration row runs under every task of the graph in turn (row i under task i mod tasks): the adapters of one
layer change the next layer's input, so every task's path is seen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import InputError
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.tokenize import Encoder

from ..model import FusionModel
from ..validate import grid_inputs

BATCH = 16  # calibration rows per forward pass
MAX_ROWS = 4096  # a larger file is cut to its first MAX_ROWS rows: per-channel maxima settle long before


@dataclass(frozen=True)
class Calibration:
    """Feeds for the graph (every input it may read, task_id per row) and where they came from."""

    feeds: list[dict[str, np.ndarray]]  # input_ids, attention_mask, token_type_ids (batch, seq), task_id (batch,)
    source: str  # the file, or "validation grid (random token ids)"
    rows: int

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "rows": self.rows, "batches": len(self.feeds)}


def read_calibration(path: str | Path) -> list[TextInput]:
    """The texts of a calibration file. Raises InputError naming the file (and the line) for a file that cannot be
    read, a line that is not a JSON object with a string "text" (and optionally "text_pair"), or a file with no rows."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--calibration {path}: cannot read it: {exc}") from None
    texts: list[TextInput] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"--calibration {path}:{no}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise InputError(
                f"--calibration {path}:{no}: each line must be an object with a string 'text' (and optionally "
                f"'text_pair'), got {_what(obj)}"
            )
        try:
            texts.append(TextInput.from_json({k: v for k, v in obj.items() if k in ("text", "text_pair")}))
        except InputError as exc:
            raise InputError(f"--calibration {path}:{no}: {exc}") from None
        if len(texts) == MAX_ROWS:
            break
    if not texts:
        raise InputError(f"--calibration {path}: no rows (an empty file); give at least one text")
    return texts


def _what(obj: object) -> str:
    """What a calibration line holds instead of an object with a string 'text'."""
    if not isinstance(obj, dict):
        return type(obj).__name__
    if "text" in obj:
        return f"'text' of type {type(obj['text']).__name__}"
    return f"keys {sorted(obj)}"


def calibration_inputs(model: FusionModel, max_seq_len: int, path: str | None, encoder: Encoder | None) -> Calibration:
    """The calibration feeds (every input a graph may read: run them with those it does) from the file ``path`` (tokenized by ``encoder``,
    rows sorted by length so batches pad little), or the validation grid when ``path`` is None.
    Raises InputError for a bad file (``read_calibration``), ValueError for a file without an encoder."""
    tasks = len(model.task_index)
    if path is None:
        cases = grid_inputs(model.backbone.vocab_size, max_seq_len, seed=2)
        batches = [feeds for _, _, feeds in cases]
        source = "validation grid (random token ids)"
    else:
        if encoder is None:
            raise ValueError("a calibration file needs the artifact's tokenizer")
        texts = read_calibration(path)
        enc = encoder.encode(texts)
        order = np.argsort(enc.attention_mask.sum(1), kind="stable")
        batches = []
        for start in range(0, len(texts), BATCH):
            rows = enc.rows(order[start : start + BATCH])
            batches.append(
                {"input_ids": rows.input_ids, "attention_mask": rows.attention_mask, "token_type_ids": rows.token_type_ids}
            )
        source = str(path)
    feeds, done = [], 0
    for b in batches:
        n = len(b["input_ids"])
        task_id = (np.arange(done, done + n, dtype=np.int64) % tasks) if tasks > 1 else np.zeros(1, dtype=np.int64)
        feeds.append({**b, "task_id": task_id})
        done += n
    return Calibration(feeds, source, done)


def with_types(src: Path, dst: Path) -> Path:
    """``src`` saved to ``dst`` with the element type (no shape) of every intermediate tensor declared: the static
    quantizer skips, silently but for a warning, the activations whose type ONNX's shape inference cannot give, which
    is every output of the optimized graph's contrib operators (Attention, SkipLayerNormalization, ...) and everything
    after them. ONNX Runtime's symbolic shape inference knows those operators; its shapes are not trusted (it fixes
    dynamic dimensions of the heads), only its element types."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    inferred = SymbolicShapeInference.infer_shapes(onnx.load(str(src)), auto_merge=True)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info if v.type.tensor_type.elem_type}
    del inferred
    graph = onnx.load(str(src))
    del graph.graph.value_info[:]
    graph.graph.value_info.extend(onnx.helper.make_tensor_value_info(name, t, None) for name, t in types.items())
    onnx.save(graph, str(dst), save_as_external_data=src.stat().st_size > 1_800_000_000)
    return dst


class FeedReader:
    """onnxruntime.quantization's CalibrationDataReader over a list of feeds (static quantization's calibration)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)
