"""Tiny random models of every supported backbone (BERT, RoBERTa, XLM-RoBERTa, DistilBERT), each with its own kind of
tokenizer made in-process, and AdapterFusion models on them built and saved by the real AdapterHub ``adapters`` library
with either adapter architecture (``seq_bn``: Pfeiffer, ``double_seq_bn``: Houlsby), for the parity tests.

Nothing here is fusionserve code: the reference is the library's own ``AutoAdapterModel``, saved with its own save
functions. Tokenizers: BERT and DistilBERT get the WordPiece vocabulary of ``adapterhub_models``; RoBERTa a byte-level
BPE trained on the test sentences; XLM-RoBERTa a SentencePiece-style Unigram model over a fixed word list (the Unigram
trainer needs more text than a test has to learn word pieces; it returns single characters here).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.adapterhub_models import PAIRS, SENTENCES, VOCAB, WORDS, save_spec

ARCHS = ("bert", "roberta", "xlm-roberta", "distilbert")
ADAPTER_CONFIGS = ("seq_bn", "double_seq_bn")
LAYERS, HIDDEN = 3, 32
MAX_POSITIONS = 66  # RoBERTa's positions start after the pad id (1): 64 tokens
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # RoBERTa / XLM-R ids 0..3

# task -> (kind, adapters, fusion config, labels): every task kind, both fusion configs
TASKS = {
    "dyn": ("fusion", ["alpha", "beta", "gamma"], "dynamic", ["entailment", "neutral", "contradiction"]),
    "stat": ("fusion", ["beta", "alpha"], "static", ["yes", "no"]),
    "single": ("adapter", ["gamma"], None, ["neg", "pos"]),
    "head": ("head", [], None, ["off", "on"]),
}


def _texts() -> list[str]:
    return [*SENTENCES, *(t for pair in PAIRS for t in pair), " ".join(WORDS)]


def _bpe_tokenizer() -> object:
    """RoBERTa: a byte-level BPE trained on the test sentences, RoBERTa's specials and post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import RobertaTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[*SPECIALS, "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(), trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return RobertaTokenizerFast(tokenizer_object=tok, model_max_length=MAX_POSITIONS - 2)


def _unigram_tokenizer() -> object:
    """XLM-RoBERTa: a SentencePiece-style Unigram model (Metaspace), XLM-R's specials and pair template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import XLMRobertaTokenizerFast

    pieces = [(s, 0.0) for s in SPECIALS] + [("▁" + w, -2.0) for w in WORDS] + [("▁", -4.0)]
    pieces += [(c, -5.0) for c in string.ascii_lowercase] + [("<mask>", 0.0)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return XLMRobertaTokenizerFast(tokenizer_object=tok, model_max_length=MAX_POSITIONS - 2)


def write_base(folder: Path, arch: str, seed: int = 0) -> None:
    """A random tiny ``arch`` model saved as an ordinary HF model folder, with its tokenizer."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    shared = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=37)
    if arch in ("bert", "distilbert"):
        (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        tok_cls = tf.BertTokenizerFast if arch == "bert" else tf.DistilBertTokenizerFast
        tok = tok_cls(vocab_file=str(folder / "vocab.txt"))
    else:
        tok = _bpe_tokenizer() if arch == "roberta" else _unigram_tokenizer()
    tok.save_pretrained(str(folder))
    vocab = len(tok)
    torch.manual_seed(seed)
    if arch == "bert":
        model = tf.BertModel(tf.BertConfig(**shared, vocab_size=vocab))
    elif arch == "distilbert":
        cfg = tf.DistilBertConfig(
            dim=HIDDEN, n_layers=LAYERS, n_heads=4, hidden_dim=37, vocab_size=vocab, max_position_embeddings=64
        )
        model = tf.DistilBertModel(cfg)
    else:
        cls, model_cls = (tf.RobertaConfig, tf.RobertaModel) if arch == "roberta" else (tf.XLMRobertaConfig, tf.XLMRobertaModel)
        cfg = cls(**shared, vocab_size=vocab, type_vocab_size=1, max_position_embeddings=MAX_POSITIONS, pad_token_id=1)
        model = model_cls(cfg, add_pooling_layer=False)
    model.save_pretrained(str(folder))


@dataclass
class BuiltArch:
    arch: str
    adapter_config: str
    spec: Path
    reference: torch.nn.Module  # the adapters library's AutoAdapterModel with everything loaded
    tokenizer: object

    def reference_logits(self, task: str, batch: dict[str, torch.Tensor], fusion_attentions: bool = False) -> object:
        """AdapterHub's logits for ``task`` (with ``fusion_attentions``: its whole output, attentions included)."""
        from adapters.composition import Fuse
        from adapters.methods.modeling import BertFusion

        kind, names, _, _ = TASKS[task]
        model = self.reference
        model.set_active_adapters(Fuse(*names) if kind == "fusion" else names[0] if kind == "adapter" else None)
        model.active_head = task
        for module in model.modules():  # the library anneals T even in eval; a trained model sits at 1
            if isinstance(module, BertFusion):
                module.T = 1.0
        with torch.no_grad():
            out = model(**batch, output_adapter_fusion_attentions=fusion_attentions)
        return out if fusion_attentions else out.logits


def _adapter_config(name: str, **kw: object) -> object:
    from adapters import DoubleSeqBnConfig, SeqBnConfig

    return (SeqBnConfig if name == "seq_bn" else DoubleSeqBnConfig)(**kw)


def build_arch(root: Path, arch: str, adapter_config: str, seed: int = 0) -> BuiltArch:
    """Three adapters of ``adapter_config`` (one with leave_out, one scaled), a 'dynamic' and a 'static' fusion, a
    single-adapter task and a head-only task on a tiny ``arch``, every adapter, fusion and head weight moved away from
    its init, saved the library's way (safetensors), with a spec over the saved folders."""
    import adapters
    from adapters import AutoAdapterModel
    from adapters.composition import Fuse
    from transformers import AutoTokenizer

    assert adapters.__version__ == "1.3.0", adapters.__version__
    write_base(root / "base", arch, seed)
    model = AutoAdapterModel.from_pretrained(str(root / "base"))
    model.add_adapter("alpha", config=_adapter_config(adapter_config, reduction_factor=4))
    model.add_adapter("beta", config=_adapter_config(adapter_config, reduction_factor=8, leave_out=[1]))
    model.add_adapter("gamma", config=_adapter_config(adapter_config, reduction_factor=2, scaling=0.5))
    for task, (kind, names, fusion_cfg, labels) in TASKS.items():
        if kind == "fusion":
            model.add_adapter_fusion(Fuse(*names), config=fusion_cfg)
        model.add_classification_head(task, num_labels=len(labels), id2label=dict(enumerate(labels)))
    # fusion weights moved less: at 0.3 the softmax is nearly one-hot (max weight ~0.97), and float rounding
    # differences between two implementations of a needle-sharp softmax approach the 1e-4 parity tolerance
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapters." in name or name.startswith("heads."):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "adapter_fusion_layer" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.eval()
    save_spec(model, root, TASKS)
    return BuiltArch(arch, adapter_config, root / "model.yaml", model, AutoTokenizer.from_pretrained(str(root / "base")))


if __name__ == "__main__":  # python -m tests.backbone_models DIR [ARCH] [ADAPTER_CONFIG]: a tiny demo model
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-model")
    arch = sys.argv[2] if len(sys.argv) > 2 else "roberta"
    config = sys.argv[3] if len(sys.argv) > 3 else "double_seq_bn"
    print(build_arch(out, arch, config).spec)
