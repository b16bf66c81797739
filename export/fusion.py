"""What replaces a BERT layer's ``output.LayerNorm(f + a)``: plain, one adapter, or AdapterFusion in folded form.

Every block takes ``f`` (FFN output before the residual), ``a`` (attention block output) and the layer's own
pretrained LayerNorm, and returns the layer output plus, for fusion, the softmax weights over adapters.

The fusion block is the exact algebra of shared/design.md section 2, pushed one step further so that no
(batch, seq, N, hidden) tensor and no hidden x hidden product is left per adapter:

    score_n = z_n . u,   u = K^T (Q q + b_q)         (the b_k term is equal for all n: softmax drops it)
            = h_n . (W_up_n^T M q + W_up_n^T c) + b_up_n . (M q + c),   M = K^T Q,  c = K^T b_q
    o       = V sum_n s_n z_n = (V W_up) (s (x) h) + sum_n s_n V b_up_n

with h_n = act(W_down_n x + b_down_n). All products of weight matrices are folded once, in float64, at
build time. Per token and layer this costs ~3 N r H + 2 N H multiply-adds instead of the reference's
(1 + 2N) H^2. Adapters with different bottleneck sizes are zero-padded to the largest: act(0) = 0 for every
supported activation and the padded rows and columns are zero, so padding changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import AdapterLayer, FusionLayer

Activation = Callable[[torch.Tensor], torch.Tensor]

_ACTIVATIONS: dict[str, Activation] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
    "tanh": torch.tanh,
    "silu": F.silu,
    "swish": F.silu,
    "leakyrelu": F.leaky_relu,
}


def activation(name: str) -> Activation:
    """The activation function AdapterHub uses for ``name`` (names were validated when the checkpoint was read)."""
    return _ACTIVATIONS[name]


class PlainBlock(nn.Module):
    """No adapter in this layer for this task: the pretrained BERT output."""

    def forward(self, f: torch.Tensor, a: torch.Tensor, ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor | None]:
        return ln(f + a), None


class AdapterBlock(nn.Module):
    """One seq_bn adapter: out = LN(z + f + a) with z = adapter(LN(f + a))."""

    def __init__(self, weights: AdapterLayer, act: str) -> None:
        super().__init__()
        self.act_name = act
        self.register_buffer("down_w", weights.down_w.clone())  # (r, hidden)
        self.register_buffer("down_b", weights.down_b.clone())
        self.register_buffer("up_w", weights.up_w.clone())  # (hidden, r)
        self.register_buffer("up_b", weights.up_b.clone())

    def forward(self, f: torch.Tensor, a: torch.Tensor, ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = ln(f + a)  # (batch, seq, hidden)
        z = F.linear(activation(self.act_name)(F.linear(x, self.down_w, self.down_b)), self.up_w, self.up_b)
        return ln(z + f + a), None


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if t.shape[0] < rows else t


class FoldedFusionBlock(nn.Module):
    """AdapterFusion over the adapters present in one layer, folded (see module docstring).

    ``positions[i]`` is where ``adapters[i]`` sits in the fusion's full adapter list of length ``n_total``;
    the returned activations are (batch, seq, n_total), zero for adapters absent from this layer.
    """

    def __init__(
        self,
        adapters: Sequence[AdapterLayer],
        act: str,
        fusion: FusionLayer,
        positions: Sequence[int],
        n_total: int,
        query_before_ln: bool,
    ) -> None:
        super().__init__()
        if not adapters or len(adapters) != len(positions):
            raise ValueError(f"need one position per adapter, got {len(adapters)} adapters and {len(positions)} positions")
        self.act_name = act
        self.query_before_ln = query_before_ln
        self.n_total = n_total
        self.n = len(adapters)
        self.r = max(ad.down_w.shape[0] for ad in adapters)
        hidden = adapters[0].up_b.shape[0]
        d = torch.float64
        eye = torch.eye(hidden, dtype=d)
        q_w = fusion.query_w.to(d) if fusion.query_w is not None else eye
        q_b = fusion.query_b.to(d) if fusion.query_b is not None else torch.zeros(hidden, dtype=d)
        k_w = fusion.key_w.to(d) if fusion.key_w is not None else eye
        v_w = fusion.value_w.to(d) if fusion.value_w is not None else eye
        m = k_w.T @ q_w  # (hidden, hidden): u = M q + c
        c = k_w.T @ q_b  # (hidden,)

        down_w = torch.cat([_pad_rows(ad.down_w.to(d), self.r) for ad in adapters])  # (N*r, hidden)
        down_b = torch.cat([_pad_rows(ad.down_b.to(d), self.r) for ad in adapters])  # (N*r,)
        up_w = torch.cat([_pad_rows(ad.up_w.to(d).T, self.r) for ad in adapters]).T  # (hidden, N*r)
        up_b = torch.stack([ad.up_b.to(d) for ad in adapters])  # (N, hidden)
        score_w = up_w.T @ m  # (N*r, hidden): per bottleneck unit, its share of z_n . u
        score_b = up_w.T @ c  # (N*r,)
        bias_w = up_b @ m  # (N, hidden): b_up_n . u
        bias_b = up_b @ c  # (N,)
        if query_before_ln:
            self.register_buffer("in_w", down_w.float())
            self.register_buffer("in_b", down_b.float())
            self.register_buffer("q_w", torch.cat([score_w, bias_w]).float())  # (N*r + N, hidden)
            self.register_buffer("q_b", torch.cat([score_b, bias_b]).float())
        else:  # query is the adapter input: one GEMM for down-projection and scores
            self.register_buffer("in_w", torch.cat([down_w, score_w, bias_w]).float())  # (2*N*r + N, hidden)
            self.register_buffer("in_b", torch.cat([down_b, score_b, bias_b]).float())
        self.register_buffer("out_w", (v_w @ up_w).float())  # (hidden, N*r)
        self.register_buffer("out_b", (up_b @ v_w.T).float())  # (N, hidden)
        self.register_buffer("positions", torch.tensor(list(positions), dtype=torch.long), persistent=False)

    def forward(self, f: torch.Tensor, a: torch.Tensor, ln: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, r = self.n, self.r
        x = ln(f + a)  # (batch, seq, hidden)
        y = F.linear(x, self.in_w, self.in_b)  # (batch, seq, N*r [+ N*r + N])
        if self.query_before_ln:
            down, scores_in = y, F.linear(f, self.q_w, self.q_b)
        else:
            down, scores_in = y[..., : n * r], y[..., n * r :]
        h = activation(self.act_name)(down).unflatten(-1, (n, r))  # (batch, seq, N, r)
        g = scores_in[..., : n * r].unflatten(-1, (n, r))  # (batch, seq, N, r)
        scores = (h * g).sum(-1) + scores_in[..., n * r :]  # (batch, seq, N)
        s = torch.softmax(scores, dim=-1)  # (batch, seq, N)
        mixed = (h * s.unsqueeze(-1)).flatten(-2)  # (batch, seq, N*r)
        o = F.linear(mixed, self.out_w) + s @ self.out_b  # (batch, seq, hidden)
        out = ln(o + f + a)
        if self.n == self.n_total:
            return out, s
        full = s.new_zeros((*s.shape[:-1], self.n_total))
        return out, full.index_copy(-1, self.positions, s)
