"""The served model in PyTorch: one frozen HF encoder (``backbone.py``: BERT, RoBERTa, XLM-RoBERTa, DistilBERT), the
blocks that replace the LayerNorm after each attention block and each FFN (plain / adapter / folded fusion, see
``fusion.py``), shared by all tasks, and a classification head per task.

Built from plain transformers modules (no ``adapters.init`` patching), so the exported graph keeps the
attention pattern ONNX Runtime's transformer optimizer fuses. ``forward`` is pure: no state changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fusionserve.errors import SpecError

from .backbone import Backbone, attention_bias
from .checkpoint import Site
from .head import HeadCheckpoint
from .nonlinearity import activation


@dataclass(frozen=True)
class TaskInfo:
    """What a caller needs to know about a task: its kind, labels in id order, and the adapters it uses."""

    name: str
    kind: Literal["fusion", "adapter", "head"]
    labels: tuple[str, ...]
    adapters: tuple[str, ...]  # fusion: in the fusion's order (the activation columns); adapter: one name
    adapters_per_layer: tuple[tuple[str, ...], ...]  # which of them act at each fusion site (leave_out removes some)


HEAD_TABLES = "task.head."  # prefix of the live graph's head tables: w0, b0, w1, b1, ...


@dataclass(frozen=True)
class HeadForm:
    """What every head of a live graph shares: the stacked head tables hold only weights."""

    layers: int
    activation: str | None
    use_pooler: bool

    @classmethod
    def of(cls, head: ClassificationHead) -> HeadForm:
        return cls(len(head.linears), head.act_name, head.use_pooler)

    def describe(self) -> str:
        return f"{self.layers} linear layer(s), activation {self.activation}, use_pooler {self.use_pooler}"


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


class FusionModel(nn.Module):
    """The frozen backbone + every adapter, fusion layer and head of a spec, in one module: the graph that gets exported.

    ``blocks`` holds one block per place of the backbone, 2 x layers in computation order (``Site.index``: after each
    layer's attention block, after its FFN); ``sites`` are the places whose fusion weights are reported (the rows of
    the fusion activations: the FFN places only, or every place when some adapter sits after the attention block).
    ``forward`` takes a task index and returns padded logits and the fusion activations over all adapters;
    ``classify`` is the by-name view of it. Both are pure: nothing in them changes state.
    """

    def __init__(
        self,
        backbone: Backbone,
        blocks: list[nn.Module],
        heads: list[ClassificationHead],
        infos: list[TaskInfo],
        adapter_names: tuple[str, ...],
        sites: tuple[Site, ...],
        stacks: list[tuple[str, ...]],
    ) -> None:
        super().__init__()
        if len(blocks) != 2 * backbone.n_layers or len(stacks) != len(sites):
            raise ValueError(f"{len(blocks)} blocks for {backbone.n_layers} layers, {len(stacks)} stacks for {len(sites)} sites")
        self.backbone = backbone
        self.blocks = nn.ModuleList(blocks)  # one per place, shared by all tasks
        self.heads = nn.ModuleList(heads)  # one per task, in task-index order
        self.infos = {info.name: info for info in infos}
        self.task_index = {info.name: i for i, info in enumerate(infos)}
        self.adapter_names = adapter_names  # the columns of the fusion activations
        self.sites = sites  # the rows of the fusion activations
        self.stacks = stacks  # per site, the adapters in its stack
        self.max_labels = max(len(info.labels) for info in infos)
        self.use_pooler = any(h.use_pooler for h in heads)
        for i, stack in enumerate(stacks):  # (N_site, N_all) one-hot: site stack -> activation columns
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
        tables: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, max_labels), zero-padded past the task's labels, and the fusion activations
        (batch, sites, seq, n_adapters) over ``adapter_names``, zero where the task does not mix an adapter.
        ``task_id`` is an int64 tensor of shape (1,), the task of every row, or (batch,), each row's task. Backbones
        without token types do not read ``token_type_ids`` (the exported graph then has no such input).
        ``tables``: every per-task tensor by its ``live.table_names`` name (the live graph, whose tasks are inputs);
        None: the model's own tasks."""
        bb = self.backbone
        h = bb.embed(input_ids, token_type_ids)  # (batch, seq, hidden)
        bias = attention_bias(attention_mask, h.dtype)  # (batch, 1, 1, seq)
        weights: list[torch.Tensor | None] = []
        for i in range(bb.n_layers):
            # the projections are computed here, outside the blocks: fp16 export keeps the blocks' nodes in fp32
            dense, ln = bb.attention_output(i)
            ctx = bb.context(i, h, bias)  # (batch, seq, hidden)
            a, s = self.blocks[2 * i](F.linear(ctx, dense.weight), dense.bias, h, ln, task_id, _block(tables, 2 * i))
            weights.append(s)
            dense, ln = bb.ffn_output(i)
            inner = bb.intermediate(i, a)  # (batch, seq, intermediate)
            h, s = self.blocks[2 * i + 1](F.linear(inner, dense.weight), dense.bias, a, ln, task_id, _block(tables, 2 * i + 1))
            weights.append(s)
        acts = []
        for row, site in enumerate(self.sites):
            s, expand = weights[site.index], getattr(self, f"expand_{row}")
            acts.append(s @ expand if s is not None else h.new_zeros((*h.shape[:2], expand.shape[1])))
        cls = bb.pool(h) if self.use_pooler else h[:, 0]  # (batch, hidden)
        if tables is not None:
            return self._live_heads(cls, task_id, tables), torch.stack(acts, dim=1)
        logits = torch.stack([self._padded_head(head, h[:, 0], cls) for head in self.heads])  # (tasks, batch, max_labels)
        if len(self.heads) == 1:
            logits = logits[0]
        else:  # each row's own task's head
            rows = task_id.expand(input_ids.shape[0])  # (batch,): one task for all, or one per row
            pick = rows.reshape(1, -1, 1).expand(1, -1, logits.shape[2])  # (1, batch, max_labels)
            logits = logits.gather(0, pick).squeeze(0)  # (batch, max_labels)
        return logits, torch.stack(acts, dim=1)  # (batch, max_labels), (batch, sites, seq, n_adapters)

    def _live_heads(self, cls: torch.Tensor, task_id: torch.Tensor, tables: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Every row through its own task's head, from the stacked head tables (one head form for all tasks)."""
        form = self.head_form()
        x = cls  # (batch, hidden)
        for j in range(form.layers):
            w = tables[f"{HEAD_TABLES}w{j}"].index_select(0, task_id)  # (k, out, in): k = 1 or batch
            b = tables[f"{HEAD_TABLES}b{j}"].index_select(0, task_id)  # (k, out)
            x = torch.matmul(x.unsqueeze(1), w.transpose(1, 2)).squeeze(1) + b  # (batch, out)
            if j < form.layers - 1 and form.activation is not None:
                x = activation(form.activation)(x)
        return x  # (batch, max_labels)

    def head_form(self) -> HeadForm:
        """The one head form of every task, which the live graph's stacked head tables need.

        Raises SpecError naming the two tasks whose heads differ."""
        forms = {name: HeadForm.of(head) for name, head in zip(self.task_index, self.heads, strict=True)}
        first = next(iter(forms))
        for name, form in forms.items():
            if form != forms[first]:
                raise SpecError(
                    f"live tasks need one head form for every task: '{first}' has {forms[first].describe()}, "
                    f"'{name}' has {form.describe()}"
                )
        return forms[first]

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
        (batch, sites, seq, n) over the task's fused adapters in the fusion's order (zero where one is absent).

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


def _block(tables: Mapping[str, torch.Tensor] | None, index: int) -> dict[str, torch.Tensor] | None:
    """Block ``index``'s own tables out of the live graph's (by field name), or None."""
    if tables is None:
        return None
    prefix = f"task.blocks.{index}."
    return {k[len(prefix) :]: v for k, v in tables.items() if k.startswith(prefix)}
