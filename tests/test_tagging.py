"""Tagging post-processing (serving/model/tagging.py) against the real ``transformers.pipeline("token-classification")``:
the same tiny random tagger's logits, the same texts (accents, punctuation, sub-words, runs of spaces, non-Latin
scripts, unknown characters), three tokenizer kinds (WordPiece, byte-level BPE, Unigram), every aggregation
strategy: the same tokens and entities, words, offsets, and scores to 1e-6."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from transformers import pipeline

from fusionserve.errors import InputError
from fusionserve.serving.model.tagging import AGGREGATIONS, tag
from tests.pipeline_helpers import TEXTS, TOKENIZER_KINDS, artifact_tokenizer, hf_tokenizer, logits_of, tagger

LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "DATE")  # "DATE": a label without a B-/I- prefix
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module", params=TOKENIZER_KINDS)
def setup(request, tmp_path_factory):
    hf = hf_tokenizer(request.param)
    tok = artifact_tokenizer(hf, tmp_path_factory.mktemp(request.param))
    tok.no_padding()
    tok.no_truncation()
    return request.param, hf, tok


def _ours(tok, model, text: str, **kwargs) -> dict:
    enc = tok.encode(text)
    logits = logits_of(model, enc.ids)
    return tag(tok, text, LABELS, logits, enc.ids, enc.offsets, [bool(s) for s in enc.special_tokens_mask], **kwargs)


def _same(ours: list[dict], theirs: list[dict], score_key: str = "score") -> None:
    assert len(ours) == len(theirs), (ours, theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert {k: v for k, v in a.items() if k != score_key} == {k: v for k, v in b.items() if k != score_key}
        assert a[score_key] == pytest.approx(float(b[score_key]), abs=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_tokens_and_entities_equal_the_pipelines(setup, aggregation):
    kind, hf, tok = setup
    compared = 0
    for seed in SEEDS:
        model = tagger(hf.vocab_size if kind == "wordpiece" else len(hf), LABELS, seed)
        nlp = pipeline("token-classification", model=model, tokenizer=hf, aggregation_strategy=aggregation)
        for text in TEXTS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the pipeline warns of its word heuristic for BPE and Unigram
                theirs = nlp(text)
            ours = _ours(tok, model, text, aggregation=aggregation)
            _same(ours["tokens" if aggregation == "none" else "entities"], theirs)
            compared += len(theirs)
    assert compared > 20  # the texts gave entities to compare


def test_the_ids_we_tag_are_the_pipelines_ids(setup):
    _, hf, tok = setup
    for text in TEXTS:
        assert tok.encode(text).ids == hf(text)["input_ids"]


def test_words_are_grouped_across_sub_words(setup):
    """ "first" / "max" / "average" give one entity per word: a word cut into pieces comes back whole."""
    _, _, tok = setup
    text = TEXTS[2]
    enc = tok.encode(text)
    logits = np.full((len(enc.ids), len(LABELS)), -5.0, dtype=np.float32)
    for i in range(len(enc.ids)):  # B-PER, B-LOC, B-PER, ...: no two pieces would group on their own
        logits[i, LABELS.index("B-PER" if i % 2 else "B-LOC")] = 5.0
    special = [bool(s) for s in enc.special_tokens_mask]
    pieces = tag(tok, text, LABELS, logits, enc.ids, enc.offsets, special)["tokens"]
    assert len(pieces) > len(text.split())  # the long words were cut into pieces
    for aggregation in ("first", "max", "average"):
        words = tag(tok, text, LABELS, logits, enc.ids, enc.offsets, special, aggregation)["entities"]
        spans = [text[e["start"] : e["end"]].strip() for e in words]  # Metaspace pieces cover the space before a word
        assert {"unbelievably", "overcomplicated", "antidisestablishmentarianism"} <= set(spans), spans
        assert len(words) < len(pieces)


def test_raw_scores_are_each_tokens_logits(setup):
    kind, hf, tok = setup
    model = tagger(hf.vocab_size if kind == "wordpiece" else len(hf), LABELS, 1)
    text = TEXTS[0]
    enc = tok.encode(text)
    logits = logits_of(model, enc.ids)
    out = _ours(tok, model, text, raw_scores=True, ignore_labels=())["tokens"]
    assert [t["index"] for t in out] == [i for i, s in enumerate(enc.special_tokens_mask) if not s]
    for t in out:
        assert list(t["scores"]) == list(LABELS)
        np.testing.assert_allclose(list(t["scores"].values()), logits[t["index"]], rtol=0, atol=0)
        assert t["entity"] == max(t["scores"], key=t["scores"].get)


def test_padded_logits_and_wider_heads_are_cut_to_the_row(setup):
    """The graph's token_logits are (seq, token_width): padding rows and columns of a wider head are ignored."""
    kind, hf, tok = setup
    model = tagger(hf.vocab_size if kind == "wordpiece" else len(hf), LABELS, 2)
    text = TEXTS[1]
    enc = tok.encode(text)
    logits = logits_of(model, enc.ids)
    padded = np.zeros((logits.shape[0] + 5, logits.shape[1] + 3), dtype=np.float32)
    padded[: logits.shape[0], : logits.shape[1]] = logits
    special = [bool(s) for s in enc.special_tokens_mask]
    for aggregation in AGGREGATIONS:
        assert tag(tok, text, LABELS, padded, enc.ids, enc.offsets, special, aggregation) == tag(
            tok, text, LABELS, logits, enc.ids, enc.offsets, special, aggregation
        )


def test_ignore_labels_keeps_every_piece_when_empty(tmp_path: Path):
    hf = hf_tokenizer("bpe")
    tok = artifact_tokenizer(hf, tmp_path)
    enc = tok.encode(TEXTS[0])
    logits = np.zeros((len(enc.ids), len(LABELS)), dtype=np.float32)
    logits[:, 0] = 5.0  # every token "O"
    special = [bool(s) for s in enc.special_tokens_mask]
    assert tag(tok, TEXTS[0], LABELS, logits, enc.ids, enc.offsets, special) == {"tokens": []}
    kept = tag(tok, TEXTS[0], LABELS, logits, enc.ids, enc.offsets, special, ignore_labels=())["tokens"]
    assert len(kept) == len(enc.ids) - sum(special) and {t["entity"] for t in kept} == {"O"}
    grouped = tag(tok, TEXTS[0], LABELS, logits, enc.ids, enc.offsets, special, "simple", ignore_labels=())["entities"]
    assert [(g["entity_group"], g["start"], g["end"]) for g in grouped] == [("O", 0, len(TEXTS[0]))]


def test_unknown_strategy_and_raw_scores_with_one_are_input_errors(tmp_path: Path):
    tok = artifact_tokenizer(hf_tokenizer("bpe"), tmp_path)
    enc = tok.encode("a text")
    logits = np.zeros((len(enc.ids), len(LABELS)), dtype=np.float32)
    args = (tok, "a text", LABELS, logits, enc.ids, enc.offsets, [bool(s) for s in enc.special_tokens_mask])
    with pytest.raises(
        InputError, match=r"aggregation_strategy 'longest' is not known; allowed: none, simple, first, average, max"
    ):
        tag(*args, aggregation="longest")
    with pytest.raises(InputError, match=r"raw_scores .* needs aggregation_strategy 'none', got 'max'"):
        tag(*args, aggregation="max", raw_scores=True)
    with pytest.raises(ValueError, match="tagging logits of shape"):
        tag(tok, "a text", LABELS, logits[:2], enc.ids, enc.offsets, args[-1])
