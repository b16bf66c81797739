"""Run an artifact with ONNX Runtime: CUDA when the GPU build and a GPU are there, else CPU. No torch.

On CUDA a run goes through IO binding: per batch shape, one set of device buffers (the inputs and the outputs
asked for) is bound once and reused, so a run is one host-to-device copy per input and one device-to-host copy
per output asked for, with no device buffer allocated per run. Batches are padded to a few bucket lengths (multiples of 16 on CUDA)
so that those buffer sets, the CUDA memory arena and the kernels see few distinct shapes; the attention mask
keeps the padding out of every result. On CPU both are off unless asked for: the plain ``session.run`` path.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from fusionserve.errors import FusionServeError

from ..options import DEVICES
from . import revisions
from .artifact import Artifact, TaskEntry, load_artifact
from .binding import BindingPool, Bound
from .cpu_flags import cpu_risk
from .openvino_runtime import bf16_session
from .predictions import TextInput
from .runner import Output
from .tables import TaskTables, is_table, table_specs
from .tokenize import Encoded, Encoder, bucket_length, bucket_lengths

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
GPU_INSTALL = 'pip uninstall -y onnxruntime && pip install "fusionserve[gpu]"'
CUDA_BUCKET = 16  # default bucket size on CUDA: waste at most 15 tokens per row, 8 shapes up to 128 tokens
_POOL_SHAPES = 32  # bound buffer sets kept, one per (batch, length, outputs); the least recently used go first
TOKEN_LOGITS = "token_logits"  # the token-level heads' output: (batch, sequence, widest token-level head)
_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


class DeviceError(FusionServeError):
    """The device asked for cannot be used on this machine or with this onnxruntime build."""


def cuda_available() -> bool:
    """Whether this onnxruntime build has the CUDA provider. A usable GPU shows only when a session starts on it."""
    return CUDA in ort.get_available_providers()


def resolve_device(device: str = "auto") -> str:
    """'cuda' or 'cpu' for ``device`` (auto | cpu | cuda); auto is cuda when the CUDA provider is installed.

    Raises DeviceError for an unknown name, or for 'cuda' when this onnxruntime build has no CUDA provider."""
    if device not in DEVICES:
        raise DeviceError(f"unknown device '{device}'; allowed: {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    if cuda_available():
        return "cuda"
    if device == "cuda":
        raise DeviceError(
            f"device 'cuda' asked for, but onnxruntime {ort.__version__} has no CUDAExecutionProvider "
            f"(available: {', '.join(ort.get_available_providers())}); install the GPU build: {GPU_INSTALL} "
            "(both wheels install the same 'onnxruntime' module, so the CPU one must go first)"
        )
    return "cpu"


def providers(device: str, tf32: bool = False) -> list[Any]:
    """ONNX Runtime's provider list for a resolved ``device`` ('cuda' or 'cpu'): CUDA with its options, then CPU."""
    if device != "cuda":
        return [CPU]
    return [(CUDA, {"use_tf32": "1" if tf32 else "0"}), CPU]


def make_session(
    path: Path,
    threads: int | None = None,
    spin: bool = True,
    device: str = "auto",
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    tf32: bool = False,
) -> ort.InferenceSession:
    """An InferenceSession with all graph optimizations (``optimization``: another level, for benchmarks/cpu_options.py;
    no level was clearly faster on the exported graph, which the exporter already optimized); ``threads`` sets
    intra-op threads (default: the CPUs this process may use). ``spin=False`` stops idle worker threads from busy-waiting for the next run: right for
    a server whose other processes (HTTP proxy, ingress) need the same cores between runs. ``device``: auto |
    cpu | cuda (see ``resolve_device``); with CUDA, CPU stays last for the operators CUDA lacks. ``tf32``: let the
    CUDA provider run fp32 matrix products in TF32 (10-bit mantissas; ONNX Runtime's own default is on). Off here: an
    fp32 artifact answers as fp32 does on CPU (on an H100, TF32 moved the test model's logits by 1.0e-3, past the
    GPU tests' 1e-3), and fp16 is the fast precision on a GPU (benchmarks/RESULTS.md, "GPU latency").

    Raises FusionServeError when the file is not a loadable model, DeviceError when ``device`` is unknown or is
    'cuda' and the CUDA provider is missing or does not start (ONNX Runtime itself would fall back to CPU)."""
    chosen = providers(resolve_device(device), tf32)
    opts = ort.SessionOptions()
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = optimization
    opts.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # work of a parallel operator in shrinking blocks that idle threads take, not one fixed share per thread: a thread
    # that loses its core for a moment (to the HTTP side, to another process) no longer holds the whole operator up.
    # Measured in the server (benchmarks/RESULTS.md): +11% requests/s at 16 clients on a quiet machine, +15-23% on a
    # busy one, batch-1 latency unchanged within noise
    opts.add_session_config_entry("session.dynamic_block_base", "4")
    try:
        session = ort.InferenceSession(str(path), opts, providers=chosen)
    except Exception as exc:  # onnxruntime raises its own exception types from C++
        raise FusionServeError(f"cannot load {path} with ONNX Runtime: {exc}") from None
    if device == "cuda" and CUDA not in session.get_providers():
        raise DeviceError(
            f"device 'cuda': onnxruntime {ort.__version__} has the CUDA provider but it did not start for {path}: "
            "no usable GPU (check `nvidia-smi` and CUDA_VISIBLE_DEVICES) or the CUDA / cuDNN libraries this "
            "onnxruntime-gpu was built for are missing (see its requirements page); use --device cpu to run on CPU"
        )
    return session


def open_session(
    artifact: Artifact, threads: int | None = None, spin: bool = True, device: str = "auto", tf32: bool = False
) -> Any:
    """ONNX Runtime's session for ``artifact`` (``make_session``), or OpenVINO's for a bf16 one (``bf16_session``)."""
    if artifact.manifest.get("precision") == "bf16":
        return bf16_session(artifact.model_path, threads, device)
    return make_session(artifact.model_path, threads, spin, device, tf32=tf32)


@dataclass(frozen=True)
class Served:
    """What one run answers from: an artifact revision's tasks and (live artifacts) its stacked task tables. A request
    keeps the one it was admitted with until it is answered, whatever is published meanwhile."""

    artifact: Artifact
    tables: dict[str, np.ndarray]

    @property
    def revision(self) -> int | None:
        return self.artifact.revision


@dataclass(frozen=True)
class RowsOutput:
    """``run_rows``'s answer: per row, its task's logits, (num_labels,) for a sequence-level head and (tokens,
    num_labels) over the row's own tokens for a token-level one, and, for a fusion row when asked, its activations
    (layers, seq, task adapters)."""

    logits: list[np.ndarray]
    fusion_activations: list[np.ndarray | None]


class OnnxRunner:
    """Texts -> logits for any task of an artifact (see ``serving.runner``).

    ``device``: auto | cpu | cuda (see ``make_session``). ``io_binding``: run through
    IO binding with reused buffers; None means on for CUDA, off for CPU (where it works too). ``seq_buckets``:
    pad each batch to the next bucket length — an int N for multiples of N (0: off) or a list of lengths, capped
    at the artifact's token limit; None means 16 on CUDA, off on CPU. ``tf32``: see ``make_session`` (off).

    Raises ArtifactError / FusionServeError for an unusable artifact, DeviceError for an unusable device, and
    FusionServeError for bad ``seq_buckets``."""

    def __init__(
        self,
        artifact: Artifact | str | Path,
        threads: int | None = None,
        spin: bool = True,
        *,
        device: str = "auto",
        io_binding: bool | None = None,
        seq_buckets: int | Sequence[int] | None = None,
        tf32: bool = False,
    ) -> None:
        first = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.session = open_session(first, threads, spin, device, tf32)
        self._tables = TaskTables(first.folder, table_specs(self.session))
        self.served = Served(first, self._tables.load(first))
        self._stamp = revisions.pointer_stamp(first.folder)
        self._refresh_lock = threading.Lock()
        self.encoder = Encoder.from_file(first.tokenizer_path, first.max_seq_len, first.pad_token)
        # a graph with one task and no adapter never reads task_id: the exporter dropped that input
        self._inputs = {i.name for i in self.session.get_inputs()}
        self._task_id_shape = next((tuple(i.shape) for i in self.session.get_inputs() if i.name == "task_id"), ())
        self._outputs = {o.name: o for o in self.session.get_outputs()}
        self.device = "cuda" if self.provider == CUDA else "cpu"  # where the session runs
        risk = cpu_risk(first.manifest, self.device, getattr(self.session, "inference_precision", ""))
        if risk:
            logging.getLogger("fusionserve").warning("fusionserve: %s: %s", first.folder, risk)
        on_cuda = self.device == "cuda"
        self.io_binding = (on_cuda if io_binding is None else bool(io_binding)) and isinstance(self.session, ort.InferenceSession)
        buckets = (CUDA_BUCKET if on_cuda else 0) if seq_buckets is None else seq_buckets
        self.bucket_lengths = bucket_lengths(self.artifact.max_seq_len, buckets)
        self._pool = BindingPool(_POOL_SHAPES)

    @property
    def artifact(self) -> Artifact:
        """The artifact as its latest loaded revision has it."""
        return self.served.artifact

    def refresh(self) -> bool:
        """Load the revision a live artifact now publishes, when it changed (one ``stat`` when it did not); returns
        whether the served revision changed. Runs already under way, and requests holding the old ``served``, finish
        on it. Raises what loading the new revision raises (ArtifactError, RevisionError, TableError), keeping the old."""
        with self._refresh_lock:
            folder = self.artifact.folder
            stamp = revisions.pointer_stamp(folder)
            if stamp is None or stamp == self._stamp:
                return False
            number = revisions.current(folder)
            if number == self.served.revision:
                self._stamp = stamp
                return False
            new = load_artifact(folder, verify=False, revision=number)  # the graph and tokenizer never change
            self.served = Served(new, self._tables.load(new))
            self._stamp = stamp
            return True

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        return {name: t.labels for name, t in self.artifact.tasks.items()}

    def task(self, name: str) -> TaskEntry:
        """The task called ``name``; raises ArtifactError naming the known tasks."""
        return self.artifact.task(name)

    @property
    def provider(self) -> str:
        return str(self.session.get_providers()[0])

    def padded_length(self, seq_len: int) -> int:
        """The sequence length a batch padded to ``seq_len`` tokens is run at: its bucket, or itself."""
        return bucket_length(seq_len, self.bucket_lengths)

    def run(self, task: str, encoded: Encoded, return_fusion_activations: bool = False, served: Served | None = None) -> Output:
        """One forward pass on an encoded batch, on ``served`` (default: the latest revision). Raises ArtifactError for
        an unknown task."""
        served = served or self.served
        entry = served.artifact.task(task)
        if return_fusion_activations and entry.kind != "fusion":
            raise FusionServeError(f"task '{task}' has no fusion layer ({entry.kind} task); there are no fusion activations")
        seq = encoded.input_ids.shape[1]
        padded = self.encoder.pad_to(encoded, self.padded_length(seq))
        feeds = self._feeds(padded, np.array([entry.index]))  # one task for every row: the graph broadcasts it
        token = entry.level == "token"
        names = [TOKEN_LOGITS if token else "logits", *(["fusion_activations"] if return_fusion_activations else [])]
        out = self._session_run(names, feeds, served)
        # (batch, labels), or for a token-level head (batch, seq, labels) over the batch's own width
        logits = (out[0][:, :seq] if token else out[0])[..., : len(entry.labels)].astype(np.float32)
        acts = self._columns(out[1][:, :, :seq], entry, served) if return_fusion_activations else None
        return Output(logits, acts, encoded)

    def _feeds(self, padded: Encoded, task_ids: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {
            "input_ids": padded.input_ids,
            "attention_mask": padded.attention_mask,
            "token_type_ids": padded.token_type_ids,
            "task_id": task_ids.astype(np.int64),
        }
        return {k: v for k, v in feeds.items() if k in self._inputs}

    def _session_run(self, names: list[str], feeds: dict[str, np.ndarray], served: Served) -> list[np.ndarray]:
        if self.io_binding:
            return self._run_bound(names, feeds, served.tables)
        return list(self.session.run(names, {**feeds, **served.tables}))

    def _columns(self, acts: np.ndarray, entry: TaskEntry, served: Served) -> np.ndarray:
        """The task's own adapters' columns of the graph's fusion activations: (rows, layers, seq, task adapters)."""
        columns = [served.artifact.adapters.index(a) for a in entry.adapters]
        return acts[..., columns].astype(np.float32)

    @property
    def per_row_tasks(self) -> bool:
        """Whether the graph takes a task per row (``task_id`` of shape (batch,), or (1,) for every row); older
        artifacts take one per run."""
        shape = self._task_id_shape
        return bool(shape) and shape[0] != 1

    def run_rows(
        self, tasks: Sequence[str], encoded: Encoded, return_fusion_activations: bool = False, served: Served | None = None
    ) -> RowsOutput:
        """One batch whose row i is classified for ``tasks[i]`` on ``served`` (default: the latest revision): one
        forward pass when the graph takes a task per row, else one per task present (rows grouped by task, each group
        padded to its own longest). Fusion rows get their activations when asked; the others None. Raises
        ArtifactError for an unknown task."""
        if len(tasks) != encoded.input_ids.shape[0]:
            raise ValueError(f"{len(tasks)} tasks for {encoded.input_ids.shape[0]} rows")
        served = served or self.served
        entries = [served.artifact.task(t) for t in tasks]
        if len({e.name for e in entries}) == 1 or not self.per_row_tasks:
            return self._run_grouped(entries, encoded, return_fusion_activations, served)
        seq = encoded.input_ids.shape[1]
        feeds = self._feeds(self.encoder.pad_to(encoded, self.padded_length(seq)), np.array([e.index for e in entries]))
        wants = return_fusion_activations and any(e.kind == "fusion" for e in entries)
        levels = {e.level for e in entries}
        names = [n for n, level in (("logits", "sequence"), (TOKEN_LOGITS, "token")) if level in levels]
        out = dict(
            zip(
                [*names, "fusion_activations"],
                self._session_run([*names, *(["fusion_activations"] if wants else [])], feeds, served),
                strict=False,
            )
        )
        lengths = encoded.attention_mask.sum(axis=1)  # padding is on the right: a row's tokens are its first ones
        logits = [
            (out[TOKEN_LOGITS][i, : lengths[i]] if e.level == "token" else out["logits"][i])[..., : len(e.labels)].astype(
                np.float32
            )
            for i, e in enumerate(entries)
        ]
        acts = [
            self._columns(out["fusion_activations"][i : i + 1, :, :seq], e, served)[0] if wants and e.kind == "fusion" else None
            for i, e in enumerate(entries)
        ]
        return RowsOutput(logits, acts)

    def _run_grouped(
        self, entries: list[TaskEntry], encoded: Encoded, return_fusion_activations: bool, served: Served
    ) -> RowsOutput:
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            groups.setdefault(e.name, []).append(i)
        logits: list[np.ndarray | None] = [None] * len(entries)
        acts: list[np.ndarray | None] = [None] * len(entries)
        for task, idx in groups.items():
            fusion = return_fusion_activations and served.artifact.task(task).kind == "fusion"
            out = self.run(task, encoded if len(groups) == 1 else encoded.rows(idx), fusion, served)
            lengths = encoded.attention_mask[idx].sum(axis=1)
            for k, i in enumerate(idx):
                logits[i] = out.logits[k, : lengths[k]] if out.logits.ndim == 3 else out.logits[k]
                acts[i] = None if out.fusion_activations is None else out.fusion_activations[k]
        return RowsOutput([x for x in logits if x is not None], acts)

    def logits(self, task: str, inputs: Sequence[TextInput]) -> tuple[np.ndarray, list[bool]]:
        self.artifact.task(task)  # unknown task: a clear error before tokenizing
        enc = self.encoder.encode(inputs)
        return self.run(task, enc).logits, enc.truncated

    # --- IO binding -------------------------------------------------------------------------------------------

    def _run_bound(self, names: list[str], feeds: dict[str, np.ndarray], tables: dict[str, np.ndarray]) -> list[np.ndarray]:
        batch, seq = feeds["input_ids"].shape
        task_rows = len(feeds["task_id"]) if "task_id" in feeds else 1
        key = (batch, seq, len(names), task_rows)
        bound = self._pool.take(key) or self._bind(names, batch, seq, task_rows)
        try:
            for name, value in feeds.items():
                bound.inputs[name].update_inplace(np.ascontiguousarray(value))
            for name, value in tables.items():  # a live artifact's task tables: bound per run, as revisions change
                bound.binding.bind_cpu_input(name, value)
            self.session.run_with_iobinding(bound.binding)
            values = [v.numpy() for v in bound.binding.get_outputs()]
            # on CPU numpy() is a view of the buffer the next run of this shape overwrites: copy it before the buffers
            # go back to the pool, where another thread may take them at once; from CUDA it is a fresh copy already
            return [v.copy() for v in values] if self.device == "cpu" else values
        finally:
            self._pool.give(key, bound)

    def _bind(self, names: list[str], batch: int, seq: int, task_rows: int) -> Bound:
        where = self.device
        binding = self.session.io_binding()
        inputs = {}
        for i in self.session.get_inputs():
            if is_table(i.name):
                continue
            shape = (task_rows,) if i.name == "task_id" else (batch, seq)
            inputs[i.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, _NUMPY_TYPES[i.type], where, 0)
            binding.bind_ortvalue_input(i.name, inputs[i.name])
        for name in names:
            out_shape = self._output_shape(name, batch, seq)
            dtype = _NUMPY_TYPES.get(self._outputs[name].type)
            if out_shape is None or dtype is None:  # not what the exporter writes: ONNX Runtime allocates it per run
                binding.bind_output(name, where, 0)
            else:
                value = ort.OrtValue.ortvalue_from_shape_and_type(out_shape, dtype, where, 0)
                binding.bind_ortvalue_output(name, value)
        return Bound(binding, inputs)

    def _output_shape(self, name: str, batch: int, seq: int) -> tuple[int, ...] | None:
        # logits: (batch, max labels over tasks), its second dimension unnamed after optimization;
        # fusion_activations: (batch, layers, sequence, adapters)
        known = {"batch": batch, "sequence": seq}
        dims = []
        for i, dim in enumerate(self._outputs[name].shape):
            if isinstance(dim, int):
                dims.append(dim)
            elif dim in known:
                dims.append(known[dim])
            elif (name, i) in (("logits", 1), (TOKEN_LOGITS, 2)):
                kind = "sequence" if name == "logits" else "token"
                live = self.artifact.manifest.get("live") or {}  # a live graph's width outlives its revisions' tasks
                widths = [len(t.labels) for t in self.artifact.tasks.values() if t.level == kind]
                dims.append(int(live.get(f"{name}_width") or max(widths, default=1)))
            else:
                return None
        return tuple(dims)
