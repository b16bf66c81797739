"""Run an artifact with ONNX Runtime: CUDA when the GPU build and a GPU are there, else CPU. No torch."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from fusionserve.errors import FusionServeError

from .artifact import Artifact, load_artifact
from .predictions import TextInput
from .tokenize import Encoded, Encoder


def providers(prefer_gpu: bool = True) -> list[str]:
    """CUDA first when this onnxruntime build has it, CPU always last."""
    available = ort.get_available_providers()
    chosen = ["CUDAExecutionProvider"] if prefer_gpu and "CUDAExecutionProvider" in available else []
    return [*chosen, "CPUExecutionProvider"]


def make_session(path: Path, threads: int | None = None, prefer_gpu: bool = True, spin: bool = True) -> ort.InferenceSession:
    """An InferenceSession with all graph optimizations; ``threads`` sets intra-op threads (default: the CPUs
    this process may use). ``spin=False`` stops idle worker threads from busy-waiting for the next run: right for
    a server whose other processes (HTTP proxy, ingress) need the same cores between runs.
    Raises FusionServeError when the file is not a loadable model."""
    opts = ort.SessionOptions()
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), opts, providers=providers(prefer_gpu))
    except Exception as exc:  # onnxruntime raises its own exception types from C++
        raise FusionServeError(f"cannot load {path} with ONNX Runtime: {exc}") from None


@dataclass(frozen=True)
class Output:
    logits: np.ndarray  # (batch, num_labels) float32
    fusion_activations: np.ndarray | None  # (batch, layers, seq, n_task_adapters), when asked
    encoded: Encoded


class OnnxRunner:
    """Texts -> logits for any task of an artifact (see ``serving.predictions.Runner``)."""

    def __init__(
        self, artifact: Artifact | str | Path, threads: int | None = None, prefer_gpu: bool = True, spin: bool = True
    ) -> None:
        self.artifact = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
        self.session = make_session(self.artifact.model_path, threads, prefer_gpu, spin)
        self.encoder = Encoder.from_file(self.artifact.tokenizer_path, self.artifact.max_seq_len, self.artifact.pad_token)
        # a graph with one task and no adapter never reads task_id: the exporter dropped that input
        self._inputs = {i.name for i in self.session.get_inputs()}

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        return {name: t.labels for name, t in self.artifact.tasks.items()}

    @property
    def provider(self) -> str:
        return str(self.session.get_providers()[0])

    def run(self, task: str, encoded: Encoded, return_fusion_activations: bool = False) -> Output:
        """One forward pass on an encoded batch. Raises ArtifactError for an unknown task."""
        entry = self.artifact.task(task)
        if return_fusion_activations and entry.kind != "fusion":
            raise FusionServeError(f"task '{task}' has no fusion layer ({entry.kind} task); there are no fusion activations")
        feeds = {
            "input_ids": encoded.input_ids,
            "attention_mask": encoded.attention_mask,
            "token_type_ids": encoded.token_type_ids,
            "task_id": np.array([entry.index], dtype=np.int64),
        }
        names = ["logits", "fusion_activations"] if return_fusion_activations else ["logits"]
        out = self.session.run(names, {k: v for k, v in feeds.items() if k in self._inputs})
        logits = out[0][:, : len(entry.labels)].astype(np.float32)
        acts = None
        if return_fusion_activations:
            columns = [self.artifact.adapters.index(a) for a in entry.adapters]
            acts = out[1][..., columns].astype(np.float32)
        return Output(logits, acts, encoded)

    def logits(self, task: str, inputs: Sequence[TextInput]) -> tuple[np.ndarray, list[bool]]:
        self.artifact.task(task)  # unknown task: a clear error before tokenizing
        enc = self.encoder.encode(inputs)
        return self.run(task, enc).logits, enc.truncated
