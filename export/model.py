"""The served model in PyTorch: one frozen HF ``BertModel``, and per target task the blocks that replace each
layer's output LayerNorm (plain / adapter / folded fusion, see ``fusion.py``) plus a classification head.

Built from plain transformers modules (no ``adapters.init`` patching), so the exported graph keeps the
attention pattern ONNX Runtime's transformer optimizer fuses. ``forward`` is pure: no state changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertModel

from fusionserve.errors import SpecError

from .checkpoint import HeadCheckpoint
from .nonlinearity import activation


@dataclass(frozen=True)
class TaskInfo:
    """What a caller needs to know about a task: its kind, labels in id order, and the adapters it uses."""

    name: str
    kind: Literal["fusion", "adapter", "head"]
    labels: tuple[str, ...]
    adapters: tuple[str, ...]  # fusion: in the fusion's order (the activation columns); adapter: one name
    adapters_per_layer: tuple[tuple[str, ...], ...]  # which of them act in each layer (leave_out removes some)


class ClassificationHead(nn.Module):
    """AdapterHub's ClassificationHead at inference: [CLS] (or pooler) -> (Linear -> act)* -> Linear."""

    def __init__(self, ckpt: HeadCheckpoint) -> None:
        super().__init__()
        self.act_name = ckpt.activation
        self.use_pooler = ckpt.use_pooler
        self.linears = nn.ModuleList()
        for w, b in ckpt.linears:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            self.linears.append(lin)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        x = cls  # (batch, hidden)
        for i, lin in enumerate(self.linears):
            x = lin(x)
            if i < len(self.linears) - 1 and self.act_name is not None:
                x = activation(self.act_name)(x)
        return x  # (batch, num_labels)


class FusionBertModel(nn.Module):
    """Frozen BERT + every adapter, fusion layer and head of a spec, in one module: the graph that gets exported.

    ``forward`` takes a task index and returns padded logits and the fusion activations over all adapters;
    ``classify`` is the by-name view of it. Both are pure: nothing in them changes state.
    """

    def __init__(
        self,
        bert: BertModel,
        blocks: list[nn.Module],
        heads: list[ClassificationHead],
        infos: list[TaskInfo],
        adapter_names: tuple[str, ...],
        stacks: list[tuple[str, ...]],
    ) -> None:
        super().__init__()
        self.bert = bert
        self.blocks = nn.ModuleList(blocks)  # one per layer, shared by all tasks
        self.heads = nn.ModuleList(heads)  # one per task, in task-index order
        self.infos = {info.name: info for info in infos}
        self.task_index = {info.name: i for i, info in enumerate(infos)}
        self.adapter_names = adapter_names  # the columns of the fusion activations
        self.stacks = stacks  # per layer, the adapters in its stack
        self.max_labels = max(len(info.labels) for info in infos)
        self.use_pooler = any(h.use_pooler for h in heads)
        for i, stack in enumerate(stacks):  # (N_layer, N_all) one-hot: layer stack -> activation columns
            expand = torch.zeros(len(stack), len(adapter_names))
            for row, name in enumerate(stack):
                expand[row, adapter_names.index(name)] = 1.0
            self.register_buffer(f"expand_{i}", expand, persistent=False)
        self.requires_grad_(False)
        self.eval()

    @property
    def task_infos(self) -> dict[str, TaskInfo]:
        return dict(self.infos)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        task_id: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, max_labels), zero-padded past the task's labels, and the fusion activations
        (batch, layers, seq, n_adapters) over ``adapter_names``, zero where the task does not mix an adapter.
        ``task_id`` is an int64 tensor of shape (1,)."""
        bert = self.bert
        h = bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)  # (batch, seq, hidden)
        mask = bert.get_extended_attention_mask(attention_mask, input_ids.shape)  # (batch, 1, 1, seq)
        acts = []
        for i, (layer, block) in enumerate(zip(bert.encoder.layer, self.blocks, strict=True)):
            a = layer.attention(h, attention_mask=mask)[0]  # (batch, seq, hidden)
            f = layer.output.dense(layer.intermediate(a))  # (batch, seq, hidden), dropout is a no-op in eval
            h, s = block(f, a, layer.output.LayerNorm, task_id)
            expand = getattr(self, f"expand_{i}")
            acts.append(s @ expand if s is not None else h.new_zeros((*h.shape[:2], expand.shape[1])))
        cls = bert.pooler(h) if self.use_pooler else h[:, 0]  # (batch, hidden)
        logits = torch.stack([self._padded_head(head, h[:, 0], cls) for head in self.heads])  # (tasks, batch, max_labels)
        logits = logits[0] if len(self.heads) == 1 else logits.index_select(0, task_id).squeeze(0)
        return logits, torch.stack(acts, dim=1)  # (batch, max_labels), (batch, layers, seq, n_adapters)

    def _padded_head(self, head: nn.Module, first: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        out = head(pooled if head.use_pooler else first)  # (batch, num_labels)
        return F.pad(out, (0, self.max_labels - out.shape[-1]))

    def classify(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        *,
        task: str,
        return_fusion_activations: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, num_labels) of ``task``; with ``return_fusion_activations`` also the softmax weights
        (batch, layers, seq, n) over the task's fused adapters in the fusion's order (zero where one is absent).

        Raises SpecError for an unknown task, or when activations are asked of a task without fusion.
        """
        if task not in self.infos:
            raise SpecError(f"unknown task '{task}'; known tasks: {', '.join(self.infos)}")
        info = self.infos[task]
        if return_fusion_activations and info.kind != "fusion":
            raise SpecError(f"task '{task}' has no fusion layer ({info.kind} task); there are no fusion activations")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        task_id = torch.tensor([self.task_index[task]], dtype=torch.long)
        logits, acts = self(input_ids, attention_mask, token_type_ids, task_id)
        logits = logits[:, : len(info.labels)]
        if not return_fusion_activations:
            return logits
        columns = [self.adapter_names.index(n) for n in info.adapters]
        return logits, acts[..., columns]
