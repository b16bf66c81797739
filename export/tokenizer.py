"""The base model's tokenizer, as transformers reads it from the model folder: what the exporter copies into the
artifact and what the PyTorch runner encodes with, and the token limit the artifact records."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fusionserve.errors import CheckpointError

from .model import FusionModel


def load_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The base model folder's fast tokenizer; raises CheckpointError when the folder has none."""
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{folder}: cannot load the tokenizer (tokenizer.json, or the files its class reads): {exc}"
        ) from None
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise CheckpointError(f"{folder}: no fast tokenizer could be built from the tokenizer files")
    return tok


def max_length(tok: PreTrainedTokenizerFast, model: FusionModel) -> int:
    """Token limit: the tokenizer's, capped by what the model's position embeddings cover."""
    limit = model.backbone.max_tokens
    tok_limit = tok.model_max_length if isinstance(tok.model_max_length, int) else limit
    return min(limit, tok_limit)
