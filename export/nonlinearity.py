"""The non-linearities of AdapterHub adapters and heads, by the names their configs use: one table, read by the
checkpoint loader (which names are accepted, in this order in its messages) and by the model (what each computes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]

_TABLE: dict[str, Activation] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "silu": F.silu,
    "swish": F.silu,
    "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
    "leakyrelu": F.leaky_relu,
}
ACTIVATIONS = tuple(_TABLE)  # the accepted names


def activation(name: str) -> Activation:
    """The activation function AdapterHub uses for ``name`` (names were validated when the checkpoint was read)."""
    return _TABLE[name]
