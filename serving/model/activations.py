"""Fusion activations as data: the average over a row's real tokens (padding left out) that the server's
metrics, ``score --activations``, calibration and the training report all take, and the calibration statistics
file that ``fusionserve calibrate`` writes and ``fusionserve prune`` reads.

Stats file (JSON)::

    {"format": "fusionserve-calibration", "format_version": 1, "created_utc": ..., "model": {...}, "input": {...},
     "tasks": {"<task>": {"adapters": [...], "adapters_per_layer": [[...], ...], "examples": n, "tokens": n,
                          "mean": [[layer x adapter]], "std": [[layer x adapter]], "mean_over_layers": {adapter: x}}}}

``mean_over_layers`` averages an adapter's mean weight over the layers its fusion mixes it in. No torch here.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from fusionserve import __version__
from fusionserve.errors import FusionServeError

from .artifact import sha256

FORMAT = "fusionserve-calibration"
FORMAT_VERSION = 1


def token_sums(acts: np.ndarray, mask: np.ndarray, dtype: DTypeLike = np.float32) -> np.ndarray:
    """(batch, layers, adapters): each row's activations (batch, layers, seq, adapters) summed over its real
    tokens (``mask`` (batch, seq) is 1 there), in ``dtype``."""
    m = mask[:, None, :, None].astype(dtype)  # (batch, 1, seq, 1)
    return (acts * m).sum(axis=2)


def token_means(acts: np.ndarray, mask: np.ndarray, dtype: DTypeLike = np.float32) -> np.ndarray:
    """(batch, layers, adapters): each row's activations averaged over its real tokens, in ``dtype``."""
    m = mask[:, None, :, None].astype(dtype)  # (batch, 1, seq, 1)
    return (acts * m).sum(axis=2) / np.maximum(m.sum(axis=2), 1.0)


class CalibrationError(FusionServeError):
    """A stats file is missing, malformed, or does not describe the model it is used with."""


def stats_document(stats: dict[str, Any], model: str, input_path: Path, skipped: int) -> dict[str, Any]:
    """The stats file's content: the per-task statistics and where they came from."""
    model_path = Path(model)
    fingerprint = sha256(model_path / "manifest.json") if model_path.is_dir() else sha256(model_path)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fusionserve_version": __version__,
        "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"path": str(model_path.resolve()), "sha256": fingerprint},
        "input": {"path": str(input_path.resolve()), "sha256": sha256(input_path), "skipped_lines": skipped},
        "tasks": stats,
    }


def load_stats(path: str | Path) -> dict[str, Any]:
    """Read a stats file written by ``fusionserve calibrate``; raises CalibrationError naming what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationError(f"stats file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"cannot read stats file {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CalibrationError(f"{path}: not a stats file written by `fusionserve calibrate` (field 'format' must be '{FORMAT}')")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CalibrationError(f"{path}: format_version {doc.get('format_version')!r} is not supported; this fusionserve reads 1")
    tasks = doc.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise CalibrationError(f"{path}: field 'tasks' must map task names to statistics")
    for name, t in tasks.items():
        try:
            mean = np.asarray(t["mean"], dtype=np.float64)
            ok = mean.ndim == 2 and mean.shape[1] == len(t["adapters"]) and len(t["adapters_per_layer"]) == mean.shape[0]
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CalibrationError(
                f"{path}: tasks.{name} is malformed (needs 'adapters', 'adapters_per_layer', 'mean' layers x adapters)"
            )
    return doc
