"""The runtime on a CUDA GPU: IO binding and sequence-length buckets on the device give the CPU's results.

These tests are marked ``gpu``: they need onnxruntime-gpu and a usable CUDA device, and skip themselves (with the
reason) elsewhere. The same code paths run on CPU in test_runtime.py."""

import numpy as np
import onnxruntime as ort
import pytest

from fusionserve.errors import FusionServeError
from fusionserve.serving.model.runtime import CUDA, OnnxRunner
from tests.adapterhub_models import TASKS
from tests.runtime_helpers import FUSION_TASKS, _assert_same, _batches, _run_all

GPU_TOL = {"fp32": 1e-3, "fp16": 5e-2}  # CUDA vs CPU, logits


@pytest.fixture(scope="module")
def cuda_device(artifacts) -> None:
    """Skips unless onnxruntime has the CUDA provider and a session really starts on it."""
    if CUDA not in ort.get_available_providers():
        pytest.skip(
            f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (pip uninstall -y onnxruntime && pip install 'fusionserve[gpu]')"
        )
    try:
        OnnxRunner(artifacts.fp32, device="cuda")
    except FusionServeError as exc:  # DeviceError, or a session that fails to load on the device at all
        pytest.skip(f"CUDA provider present but unusable: {exc}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_with_io_binding_matches_cpu(artifacts, cuda_device, precision):
    gpu = OnnxRunner(artifacts[precision], device="cuda")
    assert (gpu.provider, gpu.device, gpu.io_binding, gpu.bucket_lengths) == (CUDA, "cuda", True, (16, 32))
    cpu = OnnxRunner(artifacts[precision], device="cpu")
    acts_tol = GPU_TOL["fp32"] if precision == "fp32" else None  # fp16 activations: recorded, not gated (see export)
    for task in TASKS:
        for what, inputs in _batches().items():
            _assert_same(
                _run_all(gpu, task, inputs),
                _run_all(cpu, task, inputs),
                GPU_TOL[precision],
                f"{precision} {task} {what}",
                acts_tol,
            )


@pytest.mark.gpu
def test_cuda_io_binding_matches_cuda_plain_run_and_reuses_buffers(artifacts, cuda_device):
    bound = OnnxRunner(artifacts.fp32, device="cuda")
    plain = OnnxRunner(artifacts.fp32, device="cuda", io_binding=False)
    enc = bound.encoder.encode(_batches()["padded"])
    first = bound.run("rte", enc, return_fusion_activations=True)
    kept = first.logits.copy()
    for task in FUSION_TASKS:
        _assert_same(bound.run(task, enc, True), plain.run(task, enc, True), 1e-4, task, 1e-4)
    assert len(bound._pool) == 1  # one buffer set on the device for this shape, reused by every run
    np.testing.assert_array_equal(first.logits, kept)
