"""What replaces a sub-layer's ``LayerNorm(dense(x) + residual)`` at an adapter site (after the attention block or
after the FFN, see ``checkpoint.Site``): every adapter of the site in one stack, shared by all tasks, and each task's
fusion (or single adapter, or nothing) folded into a few small matrices.

Every block takes the site's projection without its bias ``mm`` and the bias (so ``f = mm + bias`` is the sub-layer
output before the residual: the FFN output, or the attention block's), the residual ``a`` (the sub-layer's input),
the pretrained LayerNorm and the task index, and returns the site's output and the softmax weights over the stack.
As AdapterHub computes it (Pfeiffer ``seq_bn``: ``ln_before``; Houlsby ``double_seq_bn``: not)::

    x   = LN(f + a) if ln_before else f       the adapters' input, and the fusion query (f with query_before_ln)
    out = LN(o + f + a)                        o = the fusion's mix of adapter outputs (or the single adapter's)

The fusion is the exact algebra derived in docs/concepts/fusion.md, pushed one step further so that no
(batch, seq, N, hidden) tensor and no hidden x hidden product per adapter is left:

    score_n = z_n . u,   u = K^T (Q q + b_q)         (the b_k term is equal for all n: softmax drops it)
            = h_n . (W_up_n^T M q + W_up_n^T c) + b_up_n . (M q + c),   M = K^T Q,  c = K^T b_q
    o       = V sum_n s_n z_n = (V W_up) (s (x) h) + sum_n s_n V b_up_n

with h_n = act(W_down_n x + b_down_n). All products of weight matrices are folded once, in float64, when the
model is built. Per token and layer this costs ~3 N r H + 2 N H multiply-adds instead of the reference's
(1 + 2N) H^2. Adapters with different bottleneck sizes are zero-padded to the largest: act(0) = 0 for every
supported activation and the padded rows and columns are zero, so padding changes nothing.

A single-adapter task is the same computation with a one-hot softmax (scores zero, other adapters masked,
V = I); a task that adds nothing in a layer has gate 0. One graph thus serves every task from one copy of
the backbone and the adapters' down-projections; a task index selects the task's folded matrices: one index for
the whole batch, or one per row (each row gathers its task's matrices; the products become batched GEMMs), so one
pass serves a batch mixing tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import AdapterLayer, FusionLayer
from .nonlinearity import activation

# Added to the score of an adapter a task does not use: exp underflows to exactly 0, in fp16 too (finite there).
MASKED = -30000.0


@dataclass(frozen=True)
class TaskLayer:
    """One task's weights in one layer, over that layer's stack of N adapters padded to bottleneck r (float64)."""

    score_w: torch.Tensor  # (N*r + N, hidden): per bottleneck unit its share of z_n . u, then b_up_n . u
    score_b: torch.Tensor  # (N*r + N,)
    out_w: torch.Tensor  # (hidden, N*r): V W_up
    out_b: torch.Tensor  # (N, hidden): V b_up_n
    mask: torch.Tensor  # (N,): 0 for adapters the task mixes, MASKED for the others
    gate: float  # 0 when the task adds nothing in this layer
    query_before_ln: bool  # the query is f, the sub-layer output before the residual and LayerNorm


def _padded(adapters: Sequence[AdapterLayer], r: int) -> tuple[torch.Tensor, ...]:
    """down_w (N*r, H), down_b (N*r,), up_w (H, N*r), up_b (N, H) in float64, each adapter padded to r."""
    d = torch.float64

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((r - t.shape[0], *t.shape[1:]))]) if t.shape[0] < r else t

    down_w = torch.cat([pad(ad.down_w.to(d)) for ad in adapters])
    down_b = torch.cat([pad(ad.down_b.to(d)) for ad in adapters])
    up_w = torch.cat([pad(ad.up_w.to(d).T) for ad in adapters]).T
    up_b = torch.stack([ad.up_b.to(d) for ad in adapters])
    return down_w, down_b, up_w, up_b


def fold_fusion(
    stack: Sequence[AdapterLayer], r: int, members: Sequence[int], fusion: FusionLayer, query_before_ln: bool
) -> TaskLayer:
    """A fusion over ``stack[members]`` (the fused adapters present in this layer, in the fusion's order)."""
    n, hidden = len(stack), stack[0].up_b.shape[0]
    d = torch.float64
    eye = torch.eye(hidden, dtype=d)
    q_w = fusion.query_w.to(d) if fusion.query_w is not None else eye
    q_b = fusion.query_b.to(d) if fusion.query_b is not None else torch.zeros(hidden, dtype=d)
    k_w = fusion.key_w.to(d) if fusion.key_w is not None else eye
    v_w = fusion.value_w.to(d) if fusion.value_w is not None else eye
    m = k_w.T @ q_w  # (hidden, hidden): u = M q + c
    c = k_w.T @ q_b  # (hidden,)
    keep = torch.zeros(n, dtype=d)
    keep[list(members)] = 1.0
    _, _, up_w, up_b = _padded(stack, r)
    up_w = up_w * keep.repeat_interleave(r)  # non-members contribute nothing
    up_b = up_b * keep[:, None]
    score_w = torch.cat([up_w.T @ m, up_b @ m])  # (N*r + N, hidden)
    score_b = torch.cat([up_w.T @ c, up_b @ c])
    return TaskLayer(score_w, score_b, v_w @ up_w, up_b @ v_w.T, (1 - keep) * MASKED, 1.0, query_before_ln)


def fold_adapter(stack: Sequence[AdapterLayer], r: int, index: int) -> TaskLayer:
    """One adapter of the stack on its own: a one-hot softmax on ``index`` and no V."""
    n, hidden = len(stack), stack[0].up_b.shape[0]
    keep = torch.zeros(n, dtype=torch.float64)
    keep[index] = 1.0
    _, _, up_w, up_b = _padded(stack, r)
    zeros = torch.zeros(n * r + n, hidden, dtype=torch.float64)
    return TaskLayer(zeros, zeros[:, 0], up_w * keep.repeat_interleave(r), up_b * keep[:, None], (1 - keep) * MASKED, 1.0, False)


def fold_nothing(stack: Sequence[AdapterLayer], r: int) -> TaskLayer:
    """The task uses no adapter of this layer: gate 0, the pretrained output LN(f + a)."""
    n, hidden = len(stack), stack[0].up_b.shape[0]
    zeros = torch.zeros(n * r + n, hidden, dtype=torch.float64)
    return TaskLayer(zeros, zeros[:, 0], zeros[: n * r].T, zeros[:n], torch.full((n,), MASKED, dtype=torch.float64), 0.0, False)


def _rows(stacked: torch.Tensor, task_id: torch.Tensor, inner: int) -> torch.Tensor:
    """Each row's slice of a per-task tensor (tasks, *rest), shaped (k, 1 x ``inner``, *rest) to broadcast against
    (batch, seq, ...): ``task_id`` holds one task for the batch (k = 1) or one per row (k = batch). With a single
    task the slice is a constant (*rest), so that graph keeps plain weights."""
    if stacked.shape[0] == 1:
        return stacked[0]
    picked = stacked.index_select(0, task_id)  # (k, *rest)
    return picked.reshape(picked.shape[0], *([1] * inner), *stacked.shape[1:])


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, task_id: torch.Tensor) -> torch.Tensor:
    """x (batch, seq, in) through each row's task weights w (tasks, out, in) and bias b (tasks, out)."""
    if w.shape[0] == 1:
        return F.linear(x, w[0], None if b is None else b[0])
    y = torch.matmul(x, w.index_select(0, task_id).transpose(1, 2))  # (batch, seq, out): a batched GEMM per row
    return y if b is None else y + _rows(b, task_id, 1)


class PlainBlock(nn.Module):
    """No adapter at this site: the pretrained output LN(f + a) for every task."""

    def forward(
        self, mm: torch.Tensor, bias: torch.Tensor, a: torch.Tensor, ln: nn.LayerNorm, task_id: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ln(mm + bias + a), None


class AdapterLayerBlock(nn.Module):
    """All adapters present at one site, stacked and shared by every task, plus every task's folded weights.
    ``ln_before``: the adapters read LN(f + a) (``original_ln_before``, Pfeiffer), else f (Houlsby)."""

    # buffers (registered in __init__), declared for type checkers
    down_w: torch.Tensor
    down_b: torch.Tensor
    score_w: torch.Tensor
    score_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    mask: torch.Tensor
    gate: torch.Tensor
    query_before_ln: torch.Tensor

    def __init__(self, stack: Sequence[AdapterLayer], act: str, tasks: Sequence[TaskLayer], ln_before: bool = True) -> None:
        super().__init__()
        if not stack or not tasks:
            raise ValueError(f"need at least one adapter and one task, got {len(stack)} and {len(tasks)}")
        self.act_name = act
        self.ln_before = ln_before
        self.n = len(stack)
        self.r = max(ad.down_w.shape[0] for ad in stack)
        down_w, down_b, _, _ = _padded(stack, self.r)
        self.register_buffer("down_w", down_w.float())  # (N*r, hidden)
        self.register_buffer("down_b", down_b.float())
        self.register_buffer("score_w", torch.stack([t.score_w for t in tasks]).float())  # (tasks, N*r + N, hidden)
        self.register_buffer("score_b", torch.stack([t.score_b for t in tasks]).float())  # (tasks, N*r + N)
        self.register_buffer("out_w", torch.stack([t.out_w for t in tasks]).float())  # (tasks, hidden, N*r)
        self.register_buffer("out_b", torch.stack([t.out_b for t in tasks]).float())  # (tasks, N, hidden)
        self.register_buffer("mask", torch.stack([t.mask for t in tasks]).float())  # (tasks, N)
        self.register_buffer("gate", torch.tensor([t.gate for t in tasks]))  # (tasks,)
        self.register_buffer("query_before_ln", torch.tensor([t.query_before_ln for t in tasks]))  # (tasks,)
        self.any_query_before_ln = any(t.query_before_ln for t in tasks)

    def forward(
        self, mm: torch.Tensor, bias: torch.Tensor, a: torch.Tensor, ln: nn.LayerNorm, task_id: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, r = self.n, self.r
        b, t = mm.shape[0], mm.shape[1]  # explicit sizes: ONNX Runtime's symbolic shape inference follows them
        f = mm + bias  # (batch, seq, hidden): the sub-layer output
        x = ln(f + a) if self.ln_before else f  # (batch, seq, hidden)
        h = activation(self.act_name)(F.linear(x, self.down_w, self.down_b)).reshape(b, t, n, r)  # (batch, seq, N, r)
        query = torch.where(_rows(self.query_before_ln, task_id, 2), f, x) if self.any_query_before_ln else x
        y = _linear(query, self.score_w, self.score_b, task_id)  # (batch, seq, N*r + N)
        g = y[..., : n * r].reshape(b, t, n, r)  # (batch, seq, N, r)
        scores = (h * g).sum(-1) + y[..., n * r :] + _rows(self.mask, task_id, 1)  # (batch, seq, N)
        s = torch.softmax(scores, dim=-1) * _rows(self.gate, task_id, 2)  # (batch, seq, N)
        mixed = (h * s.unsqueeze(-1)).reshape(b, t, n * r)  # (batch, seq, N*r)
        o = _linear(mixed, self.out_w, None, task_id) + s @ _rows(self.out_b, task_id, 0)  # (batch, seq, hidden)
        # The bias joins the mix before the projection does: ONNX Runtime's attention fusion recognises the attention
        # block only when the LayerNorm's Add has the projection (MatMul, then Add) on one side and the layer input on
        # the other; LN(o + f + a) would hide the projection behind the adapters' Add (Houlsby: no Attention fused).
        return ln(mm + (bias + o) + a), s
