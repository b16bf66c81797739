"""The frozen base model, for each supported architecture, read from an ordinary Hugging Face folder.

Every architecture is presented the same way to the served model (``model.py``): embeddings, the additive attention
mask, and per layer the attention heads' context (before the output projection), that projection with its LayerNorm,
the FFN up to its output projection, and that projection with its LayerNorm. The two places an AdapterHub
bottleneck adapter sits (``mh_adapter``: after the attention block, ``output_adapter``: after the FFN) are exactly
"projection, then LayerNorm(projection + residual)", so one folded block serves both (``fusion.py``).

| architecture  | token types            | positions                            | ORT embedding fusion |
|---------------|------------------------|--------------------------------------|----------------------|
| bert          | token_type_ids input   | 0..seq-1                             | EmbedLayerNormalization |
| roberta       | one type (always 0)    | from input_ids, offset by pad id + 1 | none (see below)     |
| xlm-roberta   | one type (always 0)    | from input_ids, offset by pad id + 1 | none                 |
| distilbert    | none                   | 0..seq-1                             | EmbedLayerNormalization |

RoBERTa's positions count the non-pad tokens before each token (``cumsum(input_ids != pad)``). ONNX Runtime's
EmbedLayerNormalization takes positions 0..seq-1 only; its optimizer leaves RoBERTa's embeddings unfused (a TODO in
its ``fusion_embedlayer.py``), so they run as a LayerNormalization. Positions stay exactly as transformers computes
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, BertModel, DistilBertModel, PreTrainedModel, RobertaModel, XLMRobertaModel
from transformers.utils import logging as hf_logging

from fusionserve.errors import CheckpointError


@dataclass(frozen=True)
class Architecture:
    """What differs between the supported backbones, as far as export and serving are concerned."""

    name: str  # config.json model_type, and the model_type AdapterHub writes into its checkpoints
    token_types: bool  # the graph takes token_type_ids (BERT); the others have one token type or none
    embed_fusion: bool  # ONNX Runtime fuses the embeddings into EmbedLayerNormalization
    optimizer_model_type: str  # onnxruntime.transformers.optimizer model_type
    has_pooler: bool  # a head may use the pooler (use_pooler)


ARCHITECTURES = {
    "bert": Architecture("bert", token_types=True, embed_fusion=True, optimizer_model_type="bert", has_pooler=True),
    "roberta": Architecture("roberta", token_types=False, embed_fusion=False, optimizer_model_type="bert", has_pooler=True),
    "xlm-roberta": Architecture(
        "xlm-roberta", token_types=False, embed_fusion=False, optimizer_model_type="bert", has_pooler=True
    ),
    "distilbert": Architecture("distilbert", token_types=False, embed_fusion=True, optimizer_model_type="bert", has_pooler=False),
}
_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "bert": BertModel,
    "roberta": RobertaModel,
    "xlm-roberta": XLMRobertaModel,
    "distilbert": DistilBertModel,
}


def attention_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(batch, 1, 1, seq): 0 where a token may be attended to, the dtype's lowest value at padding. Written as
    transformers' BERT writes it, the mask pattern ONNX Runtime's attention fusion recognises."""
    mask = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - mask) * torch.finfo(dtype).min


class Backbone(nn.Module):
    """One frozen HF encoder behind the common interface above. ``model`` is the transformers module itself."""

    model: Any  # the transformers model; its submodules differ per architecture

    def __init__(self, model: PreTrainedModel, arch: Architecture) -> None:
        super().__init__()
        self.model = model
        self.arch = arch
        cfg = model.config
        self.n_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.n_heads = int(cfg.num_attention_heads)
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(cfg.max_position_embeddings)

    @property
    def max_tokens(self) -> int:
        """The longest input the position embeddings cover."""
        return self.max_positions

    @property
    def ffn_act(self) -> str:
        """The FFN's activation name (``gelu`` lets ONNX Runtime fuse BiasGelu)."""
        return str(self.model.config.hidden_act)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)  # (batch, seq, hidden)

    def context(self, i: int, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s attention heads over ``h`` (batch, seq, hidden), concatenated, before the output projection."""
        return self.model.encoder.layer[i].attention.self(h, attention_mask=bias)[0]  # (batch, seq, hidden)

    def attention_output(self, i: int) -> tuple[nn.Linear, nn.LayerNorm]:
        out = self.model.encoder.layer[i].attention.output
        return out.dense, out.LayerNorm

    def intermediate(self, i: int, a: torch.Tensor) -> torch.Tensor:
        """The FFN of layer ``i`` up to (not including) its output projection: (batch, seq, intermediate)."""
        return self.model.encoder.layer[i].intermediate(a)

    def ffn_output(self, i: int) -> tuple[nn.Linear, nn.LayerNorm]:
        out = self.model.encoder.layer[i].output
        return out.dense, out.LayerNorm

    def pool(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.pooler(h)  # (batch, hidden)


class RobertaBackbone(Backbone):
    """RoBERTa and XLM-RoBERTa: BERT's layers; embeddings with one token type and positions from the input ids."""

    @property
    def max_tokens(self) -> int:
        return self.max_positions - int(self.model.config.pad_token_id or 0) - 1  # positions start after the pad id

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        # token_type_ids is not read: one token type (AdapterHub's tokenizers for these models give none)
        return self.model.embeddings(input_ids=input_ids)  # (batch, seq, hidden)


class DistilBertBackbone(Backbone):
    """DistilBERT: no token types, its own module names, and attention written in BERT's form (below)."""

    @property
    def ffn_act(self) -> str:
        return str(self.model.config.activation)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embeddings(input_ids)  # (batch, seq, hidden)

    def context(self, i: int, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """transformers' DistilBERT attention up to ``out_lin``, with the mask added to the scaled scores as BERT does
        instead of ``masked_fill``: the same softmax (padding gets weight exactly 0 either way), and the graph
        pattern ONNX Runtime's attention fusion matches (its DistilBERT pattern no longer fuses in onnxruntime 1.32)."""
        att = self.model.transformer.layer[i].attention
        b, d = h.shape[0], att.dim // att.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, att.n_heads, d).transpose(1, 2)  # (batch, heads, seq, d)

        q, k, v = heads(att.q_lin(h)), heads(att.k_lin(h)), heads(att.v_lin(h))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d) + bias  # (batch, heads, seq, seq)
        weights = F.softmax(scores, dim=-1)
        return torch.matmul(weights, v).transpose(1, 2).contiguous().view(b, -1, att.n_heads * d)  # (batch, seq, hidden)

    def attention_output(self, i: int) -> tuple[nn.Linear, nn.LayerNorm]:
        layer = self.model.transformer.layer[i]
        return layer.attention.out_lin, layer.sa_layer_norm

    def intermediate(self, i: int, a: torch.Tensor) -> torch.Tensor:
        ffn = self.model.transformer.layer[i].ffn
        return ffn.activation(ffn.lin1(a))  # (batch, seq, hidden_dim)

    def ffn_output(self, i: int) -> tuple[nn.Linear, nn.LayerNorm]:
        layer = self.model.transformer.layer[i]
        return layer.ffn.lin2, layer.output_layer_norm

    def pool(self, h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("DistilBERT has no pooler")  # heads asking for one are refused when loaded


_BACKBONES: dict[str, type[Backbone]] = {
    "bert": Backbone,
    "roberta": RobertaBackbone,
    "xlm-roberta": RobertaBackbone,
    "distilbert": DistilBertBackbone,
}


def _check_config(folder: Path, cfg: object) -> Architecture:
    """The architecture of a base model config; raises CheckpointError naming the field, the value and what is allowed."""
    path = folder / "config.json"
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: field 'model_type' = {model_type!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    position = getattr(cfg, "position_embedding_type", "absolute")
    if position != "absolute":
        raise CheckpointError(f"{path}: field 'position_embedding_type' = {position!r} is not supported; only 'absolute'")
    for field in ("is_decoder", "add_cross_attention"):
        value = getattr(cfg, field, False)
        if value:
            raise CheckpointError(f"{path}: field '{field}' = {value!r} is not supported; only encoders ({field} false)")
    return ARCHITECTURES[model_type]


def load_backbone(folder: str | Path, use_pooler: bool) -> Backbone:
    """The frozen base model of ``folder``, eager attention (the form ONNX Runtime fuses). Raises CheckpointError for
    an unsupported architecture or configuration, or missing weights."""
    folder = Path(folder)
    try:
        cfg = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: cannot read the base model's config.json: {exc}") from None
    arch = _check_config(folder, cfg)
    kwargs = {"add_pooling_layer": use_pooler} if arch.has_pooler else {}
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the unused-pooler notice is expected; real problems are raised below
    try:
        model, info = _MODEL_CLASSES[arch.name].from_pretrained(
            str(folder), attn_implementation="eager", output_loading_info=True, **kwargs
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{folder}: cannot load the base model weights: {exc}") from None
    finally:
        hf_logging.set_verbosity(previous)
    if info["missing_keys"]:
        raise CheckpointError(f"{folder}: base model weights are missing {sorted(info['missing_keys'])[:8]}")
    return _BACKBONES[arch.name](model.eval(), arch)
