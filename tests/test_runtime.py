"""The runtime on CPU: IO binding with reused buffers, sequence-length buckets, device selection, replica placement.

IO binding works with the CPU provider too, and padding to a bucket is the same computation on either device, so the
code path of the GPU runtime is covered on any machine. The tests that need a CUDA device are in test_gpu.py."""

import asyncio
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from fusionserve.cli.main import main
from fusionserve.errors import FusionServeError
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runtime import CUDA, CUDA_BUCKET, DeviceError, OnnxRunner, resolve_device
from fusionserve.serving.model.tokenize import bucket_length, bucket_lengths
from fusionserve.serving.process.server import ServerConfig, placement
from fusionserve.serving.scheduler.batching import BatchLimits, BatchStats, JobResult, Scheduler
from tests.adapterhub_models import SENTENCES, TASKS
from tests.runtime_helpers import FUSION_TASKS, MAX_SEQ_LEN, _assert_same, _batches, _run_all

CPU_ONLY = ["AzureExecutionProvider", "CPUExecutionProvider"]
WITH_CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]


class SessionSpy:
    """Wraps an InferenceSession and records the (batch, sequence) of every run."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session
        self.shapes: list[tuple[int, int]] = []

    def run(self, names, feeds):
        self.shapes.append(feeds["input_ids"].shape)
        return self._session.run(names, feeds)

    def run_with_iobinding(self, binding):
        self.shapes.append(("bound",))
        return self._session.run_with_iobinding(binding)

    def __getattr__(self, name):
        return getattr(self._session, name)


# --- defaults keep the CPU path as it was --------------------------------------------------------------------


def test_cpu_defaults_are_the_plain_path(artifacts):
    runner = OnnxRunner(artifacts.fp32, device="cpu")
    assert (runner.provider, runner.device, runner.io_binding, runner.bucket_lengths) == (
        "CPUExecutionProvider",
        "cpu",
        False,
        (),
    )
    assert [runner.padded_length(n) for n in (1, 17, MAX_SEQ_LEN)] == [1, 17, MAX_SEQ_LEN]
    spy = runner.session = SessionSpy(runner.session)
    enc = runner.encoder.encode(_batches()["padded"])
    runner.run("rte", enc)
    assert spy.shapes == [enc.input_ids.shape]  # one plain session.run at the batch's own length


def test_sessions_split_parallel_work_into_dynamic_blocks(artifacts):
    # a thread that loses its core then holds no operator up (measured in the server: benchmarks/RESULTS.md)
    for spin in (True, False):
        options = OnnxRunner(artifacts.fp32, device="cpu", spin=spin).session.get_session_options()
        assert options.get_session_config_entry("session.dynamic_block_base") == "4"


# --- IO binding on the CPU provider == plain run -------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_io_binding_matches_plain_run(artifacts, precision):
    plain = OnnxRunner(artifacts[precision], device="cpu")
    bound = OnnxRunner(artifacts[precision], device="cpu", io_binding=True)
    assert bound.io_binding and bound.device == "cpu"
    spy = bound.session = SessionSpy(bound.session)
    for task in TASKS:
        for what, inputs in _batches().items():
            _assert_same(_run_all(bound, task, inputs), _run_all(plain, task, inputs), 1e-6, f"{precision} {task} {what}", 1e-6)
    assert spy.shapes and set(spy.shapes) == {("bound",)}  # every run went through the binding
    # one buffer set per (batch, length, outputs asked: logits, or logits and activations), shared by the tasks
    shapes = {bound.encoder.encode(b).input_ids.shape for b in _batches().values()}
    assert len(shapes) == 4 and len(bound._pool) == 2 * len(shapes)


def test_io_binding_results_do_not_alias_reused_buffers(artifacts):
    runner = OnnxRunner(artifacts.fp32, device="cpu", io_binding=True)
    enc = runner.encoder.encode(_batches()["padded"])
    first = runner.run("rte", enc, return_fusion_activations=True)
    kept = (first.logits.copy(), first.fusion_activations.copy())
    second = runner.run("nli", enc, return_fusion_activations=True)  # same shape: the same buffers
    assert len(runner._pool) == 1
    np.testing.assert_array_equal(first.logits, kept[0])
    np.testing.assert_array_equal(first.fusion_activations, kept[1])
    assert np.abs(second.fusion_activations[..., :2] - first.fusion_activations[..., :2]).max() > 1e-3


def test_io_binding_lets_onnx_runtime_allocate_outputs_it_cannot_size(artifacts, monkeypatch):
    runner = OnnxRunner(artifacts.fp32, device="cpu", io_binding=True)
    plain = OnnxRunner(artifacts.fp32, device="cpu")
    monkeypatch.setattr(runner, "_output_shape", lambda *args: None)  # as for a graph with unnamed dimensions
    enc = runner.encoder.encode(_batches()["pairs"])
    first = runner.run("rte", enc, return_fusion_activations=True)
    kept = first.logits.copy()
    for task in FUSION_TASKS:
        _assert_same(runner.run(task, enc, True), plain.run(task, enc, True), 1e-6, task, 1e-6)
    np.testing.assert_array_equal(first.logits, kept)


def test_io_binding_serves_concurrent_batches_of_one_shape(artifacts):
    from concurrent.futures import ThreadPoolExecutor

    runner = OnnxRunner(artifacts.fp32, device="cpu", io_binding=True, threads=1)
    plain = OnnxRunner(artifacts.fp32, device="cpu", threads=1)
    enc = runner.encoder.encode(_batches()["padded"])
    tasks = FUSION_TASKS * 4
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda t: runner.run(t, enc, return_fusion_activations=True), tasks))
    for task, out in zip(tasks, outs, strict=True):
        _assert_same(out, plain.run(task, enc, return_fusion_activations=True), 1e-6, task, 1e-6)


# --- sequence-length buckets ---------------------------------------------------------------------------------


def test_bucket_lengths():
    assert bucket_lengths(128, 16) == (16, 32, 48, 64, 80, 96, 112, 128)
    assert bucket_lengths(100, 16) == (16, 32, 48, 64, 80, 96, 100)  # capped at the token limit
    assert bucket_lengths(128, [64, 16, 32, 256]) == (16, 32, 64, 128)  # powers of two, sorted, capped
    assert bucket_lengths(128, 0) == ()
    assert [bucket_length(n, (16, 32, 40)) for n in (1, 16, 17, 33, 40)] == [16, 16, 32, 40, 40]
    assert bucket_length(7, ()) == 7


@pytest.mark.parametrize(
    "buckets, says",
    [(-1, "seq_buckets = -1 is out of range"), ([16, 0], "seq_buckets = [16, 0]"), ([], "at least one"), ("16", "seq_buckets")],
    ids=["negative", "zero_length", "empty", "string"],
)
def test_bad_buckets_are_refused(artifacts, buckets, says):
    with pytest.raises(FusionServeError) as exc:
        OnnxRunner(artifacts.fp32, device="cpu", seq_buckets=buckets)
    assert says in str(exc.value)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("io_binding", [False, True], ids=["run", "io_binding"])
def test_bucketing_changes_no_result(artifacts, precision, io_binding):
    plain = OnnxRunner(artifacts[precision], device="cpu")
    bucketed = OnnxRunner(artifacts[precision], device="cpu", seq_buckets=CUDA_BUCKET, io_binding=io_binding)
    assert bucketed.bucket_lengths == (16, 32)
    for task in TASKS:
        for what, inputs in _batches().items():
            got, want = _run_all(bucketed, task, inputs), _run_all(plain, task, inputs)
            assert got.encoded is not None and got.encoded.input_ids.shape == want.encoded.input_ids.shape
            _assert_same(got, want, 1e-5, f"{precision} {task} {what}", 1e-5)


def test_bucketing_pads_to_the_expected_lengths(artifacts):
    runner = OnnxRunner(artifacts.fp32, device="cpu", seq_buckets=[8, 20])
    assert runner.bucket_lengths == (8, 20, MAX_SEQ_LEN)
    spy = runner.session = SessionSpy(runner.session)
    seen = []
    for inputs in _batches().values():
        enc = runner.encoder.encode(inputs)
        seq = enc.input_ids.shape[1]
        runner.run("rte", enc)
        seen.append((seq, spy.shapes[-1][1]))
        assert spy.shapes[-1] == (len(inputs), runner.padded_length(seq))
    assert seen == [(6, 8), (17, 20), (12, 20), (MAX_SEQ_LEN, MAX_SEQ_LEN)]


def test_batch_metrics_count_the_bucketed_tokens(artifacts):
    inputs = (TextInput(SENTENCES[0]), TextInput(SENTENCES[1]), TextInput(SENTENCES[4]))

    def run(runner: OnnxRunner) -> tuple[list[BatchStats], JobResult]:
        batches: list[BatchStats] = []
        result = asyncio.run(Scheduler(runner, BatchLimits(max_batch_size=8), batches.append).submit("rte", inputs))
        return batches, result

    runner = OnnxRunner(artifacts.fp32, device="cpu", seq_buckets=CUDA_BUCKET)
    (got_batch,), got = run(runner)
    (want_batch,), want = run(OnnxRunner(artifacts.fp32, device="cpu"))
    seq = runner.encoder.encode(inputs).input_ids.shape[1]
    assert seq == 17 and got_batch.tokens == 3 * 32 and want_batch.tokens == 3 * 17
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got.activations, want.activations, atol=1e-5, rtol=0)


# --- device selection ----------------------------------------------------------------------------------------


def test_unknown_device_is_refused(artifacts):
    with pytest.raises(DeviceError, match="unknown device 'tpu'; allowed: auto, cpu, cuda"):
        OnnxRunner(artifacts.fp32, device="tpu")
    with pytest.raises(FusionServeError, match="--device = 'tpu' is not known; allowed: auto, cpu, cuda"):
        ServerConfig(artifacts.fp32, device="tpu")


def test_cuda_without_the_cuda_provider_names_the_gpu_extra(artifacts, monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: CPU_ONLY)
    with pytest.raises(DeviceError) as exc:
        OnnxRunner(artifacts.fp32, device="cuda")
    message = str(exc.value)
    for part in ("device 'cuda'", "no CUDAExecutionProvider", 'pip install "fusionserve[gpu]"', "pip uninstall -y onnxruntime"):
        assert part in message
    assert OnnxRunner(artifacts.fp32, device="auto").device == "cpu"  # auto falls back without a word
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"


def test_cuda_provider_that_does_not_start_is_an_error(artifacts, monkeypatch):
    if CUDA in ort.get_available_providers():
        pytest.skip("a real CUDA provider is installed: it may well start")
    # the CPU build ignores a provider it lacks and runs on CPU, as the GPU build does when no GPU is usable
    monkeypatch.setattr(ort, "get_available_providers", lambda: WITH_CUDA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnxruntime warns that it lacks the provider; the error is ours to give
        with pytest.raises(DeviceError, match="did not start"):
            OnnxRunner(artifacts.fp32, device="cuda")
        runner = OnnxRunner(artifacts.fp32, device="auto")
    assert (runner.device, runner.io_binding, runner.bucket_lengths) == ("cpu", False, ())


def test_cuda_sessions_keep_fp32_products_in_fp32_unless_tf32_is_asked(artifacts, monkeypatch):
    """ONNX Runtime's CUDA provider runs fp32 matrix products in TF32 unless told not to: on an H100 that moved the
    test model's logits by 1.0e-3 from the CPU's (test_gpu.py's fp32 check failed on it). Every CUDA session gets
    use_tf32 from ``tf32``, off unless asked."""
    seen = []

    class Recording(ort.InferenceSession):  # the CPU build ignores the CUDA entry, so the session itself still opens
        def __init__(self, path, opts=None, providers=None, **kw):
            seen.append(providers)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                super().__init__(path, opts, providers=providers, **kw)

    monkeypatch.setattr(ort, "get_available_providers", lambda: WITH_CUDA)
    monkeypatch.setattr(ort, "InferenceSession", Recording)
    OnnxRunner(artifacts.fp32, device="auto")
    OnnxRunner(artifacts.fp32, device="auto", tf32=True)
    OnnxRunner(artifacts.fp32, device="cpu", tf32=True)
    cuda = "CUDAExecutionProvider"
    assert seen == [
        [(cuda, {"use_tf32": "0"}), "CPUExecutionProvider"],
        [(cuda, {"use_tf32": "1"}), "CPUExecutionProvider"],
        ["CPUExecutionProvider"],
    ]


def test_placement_of_replicas(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: CPU_ONLY)
    assert placement("auto", 4, 2) == ("cpu", 0.0)  # no CUDA provider: CPU whatever Ray sees
    with pytest.raises(DeviceError, match='pip install "fusionserve\\[gpu\\]"'):
        placement("cuda", 4, 2)
    monkeypatch.setattr(ort, "get_available_providers", lambda: WITH_CUDA)
    assert placement("cpu", 4, 2) == ("cpu", 0.0)
    assert placement("auto", 0, 2) == ("cpu", 0.0)
    with pytest.raises(DeviceError, match="Ray sees no GPU"):
        placement("cuda", 0, 1)
    assert placement("cuda", 1, 1) == ("cuda", 1.0)
    assert placement("auto", 1, 3) == ("cuda", 1 / 3)  # three replicas share the GPU
    assert placement("cuda", 4, 2) == ("cuda", 1.0)  # one GPU each
    assert placement("cuda", 2, 3) == ("cuda", 0.5)  # two per GPU, so that all three fit


def test_serve_with_cuda_but_no_provider_fails_before_ray_starts(artifacts, monkeypatch, capsys):
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not start")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(ort, "get_available_providers", lambda: CPU_ONLY)
    assert main(["serve", str(artifacts.fp32), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusionserve: error: device 'cuda' asked for") and 'pip install "fusionserve[gpu]"' in err
