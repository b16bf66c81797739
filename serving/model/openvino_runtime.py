"""Run a bf16 artifact with OpenVINO's CPU plugin, behind the part of ``onnxruntime.InferenceSession``'s interface that
``runtime.OnnxRunner`` and the export gates use (``get_inputs``, ``get_outputs``, ``get_providers``, ``run``). No torch.

A bf16 artifact's ``model.onnx`` is the standard-op graph as the exporter traced it (before ONNX Runtime's fusions,
which OpenVINO cannot read): OpenVINO reads it, applies its own fusions and compiles it with
``INFERENCE_PRECISION_HINT=bf16``, so the matrix products run on bf16 units (AMX, AVX-512 BF16) where the CPU has them.
On a CPU with AVX-512 but no bf16 units, OpenVINO's oneDNN emulates bf16 (same rounding, fp32 arithmetic, slower);
``inference_precision`` says what the compiled model runs in. Compiled models are cached under
``<FUSIONSERVE_CACHE>/openvino`` (OpenVINO's ``CACHE_DIR``): the first start of an artifact compiles it, later ones
read the cache.
"""

from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusionserve.errors import FusionServeError, MissingDependency
from fusionserve.settings import cache_root

from .artifact import MODEL_FILE

INSTALL = "pip install 'fusionserve[openvino]'"
PROVIDER = "OpenVINO CPU"  # what ``get_providers`` names, in the place of an ONNX Runtime execution provider
# OpenVINO's element type names -> the type strings ONNX Runtime gives its inputs and outputs
_TYPES = {"i64": "tensor(int64)", "i32": "tensor(int32)", "f32": "tensor(float)", "f16": "tensor(float16)"}


def require_openvino(what: str) -> Any:
    """The ``openvino`` module; raises MissingDependency naming ``what`` needs it and how to install it."""
    try:
        return importlib.import_module("openvino")
    except ImportError:
        raise MissingDependency(f"{what} runs with OpenVINO, which is not installed here: {INSTALL}") from None


def no_bf16_here(graph: str, precision: str) -> str:
    """Why a bf16 export cannot be gated on this CPU, where OpenVINO compiles ``graph`` in ``precision`` (f32)."""
    return (
        f"OpenVINO compiles {graph} in {precision} on this CPU (it has no bf16 units and cannot emulate them without "
        "AVX-512), so the bf16 gate cannot be checked here: export bf16 on a CPU with bf16 units (amx_bf16 or "
        "avx512_bf16) or AVX-512; no artifact written"
    )


@functools.cache
def bf16_compiled_as() -> str:
    """What OpenVINO's CPU plugin compiles a graph asked for in bf16 in, on this CPU: 'bf16' (bf16 units, or AVX-512 to
    emulate them) or 'f32'; learnt from a graph of one matrix product (~0.15 CPU-s), once per process. Raises
    MissingDependency without OpenVINO."""
    ov = require_openvino("--precision bf16")
    ops = importlib.import_module("openvino.opset13")
    x = ops.parameter([1, 16], np.float32)
    product = ops.matmul(x, ops.constant(np.ones((16, 16), np.float32)), False, False)
    compiled = ov.Core().compile_model(ov.Model([product], [x]), "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
    return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())


def require_bf16_here(error: type[FusionServeError] = FusionServeError) -> None:
    """Refuse a bf16 export before anything is built (or torch imported) where OpenVINO compiles bf16 in f32 on this
    CPU (``bf16_compiled_as``): the gate could not be checked, at the end of a whole export. Raises ``error`` then,
    MissingDependency without OpenVINO (each time: what the cache above knows would hide its absence)."""
    require_openvino("--precision bf16")
    precision = bf16_compiled_as()
    if precision != "bf16":
        raise error(no_bf16_here(MODEL_FILE, precision))


def openvino_version() -> str | None:
    """The installed OpenVINO's version, or None when it is not installed."""
    try:
        return str(importlib.import_module("openvino").__version__).split("-")[0]
    except ImportError:
        return None


@dataclass(frozen=True)
class Port:
    """An input or output as ONNX Runtime describes one: name, shape (an int, or a name for a dynamic axis), type."""

    name: str
    shape: list[int | str]
    type: str


def _port(port: Any) -> Port:
    shape: list[int | str] = [int(d.get_length()) if d.is_static else "?" for d in port.get_partial_shape()]
    return Port(port.get_any_name(), shape, _TYPES.get(port.get_element_type().get_type_name(), "tensor(float)"))


class OpenVinoSession:
    """A compiled OpenVINO model with ONNX Runtime's session interface. Thread-safe: each ``run`` takes an infer
    request of its own from a pool (concurrent runs of two tasks' batches never share one)."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self._inputs = [_port(p) for p in compiled.inputs]
        self._outputs = [_port(p) for p in compiled.outputs]
        self._free: list[Any] = []
        self._lock = threading.Lock()

    @property
    def inference_precision(self) -> str:
        """What the compiled model's matrix products run in: 'bf16' or 'f32'."""
        return str(self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())

    def get_inputs(self) -> list[Port]:
        return list(self._inputs)

    def get_outputs(self) -> list[Port]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return [PROVIDER]

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs ``names`` (None: all, in the graph's order) for ``feeds``, as fresh arrays."""
        with self._lock:
            request = self._free.pop() if self._free else self.compiled.create_infer_request()
        try:
            request.infer({k: np.ascontiguousarray(v) for k, v in feeds.items()})
            wanted = names if names is not None else [o.name for o in self._outputs]
            return [np.array(request.get_tensor(name).data, copy=True) for name in wanted]
        finally:
            with self._lock:
                self._free.append(request)


def compile_graph(path: Path, precision: str = "bf16", threads: int | None = None, cache: bool = True) -> OpenVinoSession:
    """Compile the ONNX graph ``path`` for the CPU with ``precision`` (bf16 | f32) as OpenVINO's inference precision
    hint; ``threads``: OpenVINO's inference threads (default: its own, every core). One stream, latency-bound: a
    server's batches come one at a time per replica. ``cache``: keep the compiled blob in OpenVINO's model cache.

    Raises MissingDependency when OpenVINO is not installed."""
    ov = require_openvino(f"{path.parent} (a bf16 artifact)")
    core = ov.Core()
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    if cache:
        folder = cache_root() / "openvino"
        folder.mkdir(parents=True, exist_ok=True)
        config["CACHE_DIR"] = str(folder)
    return OpenVinoSession(core.compile_model(str(path), "CPU", config))


def bf16_session(path: Path, threads: int | None = None, device: str = "auto") -> OpenVinoSession:
    """A bf16 artifact's graph ``path`` compiled in bf16 (``compile_graph``), on the CPU: ``device`` auto or cpu.

    Raises FusionServeError naming the artifact for another device, MissingDependency without OpenVINO."""
    if device not in ("auto", "cpu"):
        raise FusionServeError(
            f"device '{device}': {path.parent} is a bf16 artifact, which runs on CPU (OpenVINO); "
            "use --device cpu, or an fp32 or fp16 export for CUDA"
        )
    return compile_graph(path, "bf16", threads)


def device_capabilities() -> list[str]:
    """OpenVINO's CPU plugin's OPTIMIZATION_CAPABILITIES (BF16 among them where the CPU has bf16 units); [] without
    OpenVINO."""
    try:
        ov = importlib.import_module("openvino")
    except ImportError:
        return []
    return [str(c) for c in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
