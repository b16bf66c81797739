"""The equations of docs/fusion-math.md ("What AdapterHub computes"), written the obvious way (one adapter at a time, K and V applied
to every adapter output), to check the folded implementation against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusionserve.export.checkpoint import AdapterLayer, FusionLayer
from fusionserve.export.nonlinearity import activation


def plain_fusion(
    f: torch.Tensor,
    a: torch.Tensor,
    ln: torch.nn.LayerNorm,
    adapters: list[AdapterLayer],
    act: str,
    fusion: FusionLayer,
    query_before_ln: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    x = ln(f + a)
    query = f if query_before_ln else x
    zs = [F.linear(activation(act)(F.linear(x, ad.down_w, ad.down_b)), ad.up_w, ad.up_b) for ad in adapters]
    z = torch.stack(zs, dim=2)  # (batch, seq, N, hidden)
    q = F.linear(query, fusion.query_w, fusion.query_b) if fusion.query_w is not None else query
    k = F.linear(z, fusion.key_w, fusion.key_b) if fusion.key_w is not None else z
    v = F.linear(z, fusion.value_w) if fusion.value_w is not None else z
    scores = torch.einsum("bth,btnh->btn", q, k)
    s = torch.softmax(scores, dim=-1)
    o = torch.einsum("btn,btnh->bth", s, v)
    return ln(o + f + a), s


def plain_adapter(f: torch.Tensor, a: torch.Tensor, ln: torch.nn.LayerNorm, ad: AdapterLayer, act: str) -> torch.Tensor:
    x = ln(f + a)
    z = F.linear(activation(act)(F.linear(x, ad.down_w, ad.down_b)), ad.up_w, ad.up_b)
    return ln(z + f + a)
