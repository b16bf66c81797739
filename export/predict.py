"""Run the PyTorch model of a spec on texts: the reference runner the ONNX artifact is checked against."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fusionserve.errors import SpecError
from fusionserve.serving.model.artifact import TaskEntry
from fusionserve.serving.model.predictions import TextInput
from fusionserve.serving.model.runner import Output
from fusionserve.serving.model.tokenize import Encoded, Encoder

from .build import build_model
from .spec import ModelSpec, load_spec
from .tokenizer import load_tokenizer, max_length


class TorchRunner:
    """Texts -> logits with the folded PyTorch model (see ``serving.runner``)."""

    def __init__(self, spec: ModelSpec | str | Path) -> None:
        self.spec = spec if isinstance(spec, ModelSpec) else load_spec(spec)
        self.model = build_model(self.spec)
        self.tokenizer = load_tokenizer(self.spec.base_model)
        self.encoder = Encoder(
            self.tokenizer.backend_tokenizer, max_length(self.tokenizer, self.model), str(self.tokenizer.pad_token)
        )

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        return {name: info.labels for name, info in self.model.task_infos.items()}

    def task(self, name: str) -> TaskEntry:
        """The task called ``name`` as an artifact would describe it; raises SpecError naming the known tasks."""
        if name not in self.model.infos:
            raise SpecError(f"unknown task '{name}'; known tasks: {', '.join(self.model.infos)}")
        info = self.model.infos[name]
        return TaskEntry(
            name, self.model.task_index[name], info.kind, info.labels, info.adapters, info.adapters_per_layer, info.head,
            info.num_choices,
        )  # fmt: skip

    def run(self, task: str, encoded: Encoded, return_fusion_activations: bool = False) -> Output:
        """One forward pass on an encoded batch, like ``serving.runtime.OnnxRunner.run``. Raises SpecError for an
        unknown task, or when activations are asked of a task without fusion."""
        ids, mask, types = (torch.from_numpy(t) for t in (encoded.input_ids, encoded.attention_mask, encoded.token_type_ids))
        with torch.inference_mode():
            out = self.model.classify(
                ids, mask, types, task=self.task(task).name, return_fusion_activations=return_fusion_activations
            )
        if isinstance(out, tuple):
            return Output(out[0].numpy(), out[1].numpy(), encoded)
        return Output(out.numpy(), None, encoded)

    def logits(self, task: str, inputs: Sequence[TextInput]) -> tuple[np.ndarray, list[bool]]:
        self.task(task)  # unknown task: a clear error before tokenizing
        enc = self.encoder.encode(inputs)
        return self.run(task, enc).logits, enc.truncated
