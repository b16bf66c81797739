"""The equations of docs/concepts/fusion.md ("What AdapterHub computes"), written the obvious way (one adapter at a time, K
and V applied to every adapter output), to check the folded implementation against.

At either site an adapter sits (after the attention block: ``mh_adapter``; after the FFN: ``output_adapter``)
AdapterHub's bottleneck layer takes ``f``, the sub-layer's output before its residual (the attention block's output
projection, or the FFN's), ``a``, the residual (the sub-layer's input), and the pretrained LayerNorm ``ln``, and runs
``Adapter.pre_forward``, the adapters (or the fusion over them), then ``Adapter.post_forward``:

- pre_forward, with ``residual_before_ln`` true: residual = f; query = f when the fusion has ``query_before_ln``;
  x = ln(f + a) when ``original_ln_before`` (Pfeiffer, ``ln_before`` here) else f (Houlsby); otherwise query = x
- each adapter: z_n = up(act(down(x))) (scaled); the fusion mixes them: o = sum_n s_n V z_n; output o + residual
- post_forward, with ``original_ln_after``: ln(o + residual + a)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionserve.export.checkpoint import AdapterLayer, FusionLayer
from fusionserve.export.nonlinearity import activation


def _adapter_input(f: torch.Tensor, a: torch.Tensor, ln: torch.nn.LayerNorm, ln_before: bool) -> torch.Tensor:
    return ln(f + a) if ln_before else f


def plain_fusion(
    f: torch.Tensor,
    a: torch.Tensor,
    ln: torch.nn.LayerNorm,
    adapters: list[AdapterLayer],
    act: str,
    fusion: FusionLayer,
    query_before_ln: bool = False,
    ln_before: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _adapter_input(f, a, ln, ln_before)
    residual = f
    query = f if query_before_ln else x
    zs = [F.linear(activation(act)(F.linear(x, ad.down_w, ad.down_b)), ad.up_w, ad.up_b) for ad in adapters]
    z = torch.stack(zs, dim=2)  # (batch, seq, N, hidden)
    q = F.linear(query, fusion.query_w, fusion.query_b) if fusion.query_w is not None else query
    k = F.linear(z, fusion.key_w, fusion.key_b) if fusion.key_w is not None else z
    v = F.linear(z, fusion.value_w) if fusion.value_w is not None else z
    scores = torch.einsum("bth,btnh->btn", q, k)
    s = torch.softmax(scores, dim=-1)
    o = torch.einsum("btn,btnh->bth", s, v)
    return ln(o + residual + a), s


def plain_adapter(
    f: torch.Tensor, a: torch.Tensor, ln: torch.nn.LayerNorm, ad: AdapterLayer, act: str, ln_before: bool = True
) -> torch.Tensor:
    x = _adapter_input(f, a, ln, ln_before)
    z = F.linear(activation(act)(F.linear(x, ad.down_w, ad.down_b)), ad.up_w, ad.up_b)
    return ln(z + f + a)
