"""Texts -> padded id arrays with a fast WordPiece tokenizer (``tokenizers``, no torch, no transformers), and the
bucket lengths a runtime may pad a batch to."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from fusionserve.errors import FusionServeError

from ..options import CHARS_PER_TOKEN_BUDGET
from .predictions import TextInput


@dataclass(frozen=True)
class Tokens:
    """One input's tokens, unpadded: what the server queues until a batch takes it."""

    ids: np.ndarray  # (length,) int64
    type_ids: np.ndarray  # (length,) int64
    truncated: bool  # cut to max_length

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # (batch, seq) int64, padded to the longest input of the batch
    attention_mask: np.ndarray  # (batch, seq) int64
    token_type_ids: np.ndarray  # (batch, seq) int64
    truncated: list[bool]  # per input: cut to max_length

    def rows(self, idx: Sequence[int]) -> Encoded:
        """Inputs ``idx`` as a batch of their own, padded to their longest: what encoding them alone gives."""
        sel = np.asarray(idx, dtype=np.int64)
        width = int(self.attention_mask[sel].sum(axis=1).max())  # padding is on the right

        def cut(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(a[sel, :width])

        return Encoded(cut(self.input_ids), cut(self.attention_mask), cut(self.token_type_ids), [self.truncated[i] for i in idx])


TRUNCATION_DIRECTIONS = ("right", "left")  # the first is the default


class Encoder:
    """Batch tokenizer: pairs encoded as pairs, ``longest_first`` truncation to ``max_length``, padding to the
    longest sequence in the batch (not to max_length). Every text is first cut at ``max_chars`` characters (the one
    place a text is bounded before it is tokenized: ``max_length`` x CHARS_PER_TOKEN_BUDGET), so a text of any length
    costs what that many characters cost; an input so cut is reported truncated.

    Truncation cuts the end of a text (``direction="right"``, the default) or its start (``"left"``: the last
    tokens are kept, as in dialogue and logs where the newest text matters most). Either way [CLS] and [SEP] are
    kept, and a pair is cut as ``longest_first`` cuts it: one token at a time from whichever text is longer at that
    moment, from that text's end ("right") or its start ("left"). The character cut before tokenizing keeps the same
    side: a text's first ``max_chars`` characters, or with "left" its last."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, pad_token: str = "[PAD]") -> None:
        if max_length < 3:
            raise ValueError(f"max_length must be at least 3 ([CLS] x [SEP]), got {max_length}")
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            raise FusionServeError(f"the tokenizer has no pad token {pad_token!r} in its vocabulary")
        self.max_length = max_length
        self.max_chars = max_length * CHARS_PER_TOKEN_BUDGET
        self.pad_id = int(pad_id)
        # private copies: the padding/truncation settings are ours, the caller's tokenizer is left as it was
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.no_truncation()
        self._plain.no_padding()
        self._tok: dict[str, Tokenizer] = {}  # direction -> truncating, padding to the batch's longest
        self._unpadded: dict[str, Tokenizer] = {}  # direction -> truncating, not padding
        for direction in TRUNCATION_DIRECTIONS:
            tok = Tokenizer.from_str(tokenizer.to_str())
            tok.enable_truncation(max_length=max_length, strategy="longest_first", direction=direction)
            self._unpadded[direction] = Tokenizer.from_str(tok.to_str())
            self._unpadded[direction].no_padding()
            tok.enable_padding(pad_id=pad_id, pad_token=pad_token)  # no length: pad to the batch's longest
            self._tok[direction] = tok

    @classmethod
    def from_file(cls, path: Path, max_length: int, pad_token: str = "[PAD]") -> Encoder:
        """Load ``tokenizer.json``; raises FusionServeError naming the file when it cannot."""
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception for missing or corrupt files
            raise FusionServeError(f"cannot load tokenizer {path}: {exc}") from None
        return cls(tok, max_length, pad_token)

    def count_tokens(self, inputs: Sequence[TextInput]) -> list[int]:
        """Untruncated length of each input in tokens, special tokens included: of its first ``max_chars``
        characters (``cut`` says which inputs were longer)."""
        return [len(e.ids) for e in self._plain.encode_batch([self._item(i) for i in inputs])]

    def cut(self, inputs: Sequence[TextInput]) -> list[bool]:
        """Per input: a text of it is longer than ``max_chars`` characters, so only its start is tokenized."""
        return [len(i.text) > self.max_chars or len(i.text_pair or "") > self.max_chars for i in inputs]

    def encode(self, inputs: Sequence[TextInput], direction: str = "right") -> Encoded:
        """``inputs`` as one padded batch, truncated from ``direction`` (see the class). Raises ValueError for no
        inputs or an unknown direction."""
        if not inputs:
            raise ValueError("nothing to encode")
        encs = self._pick(self._tok, direction).encode_batch([self._item(i, direction) for i in inputs])
        return Encoded(
            input_ids=np.asarray([e.ids for e in encs], dtype=np.int64),
            attention_mask=np.asarray([e.attention_mask for e in encs], dtype=np.int64),
            token_type_ids=np.asarray([e.type_ids for e in encs], dtype=np.int64),
            truncated=[len(e.overflowing) > 0 or cut for e, cut in zip(encs, self.cut(inputs), strict=True)],
        )

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer itself, neither truncating nor padding (question answering cuts its own windows)."""
        return self._plain

    def tagged(self, inputs: Sequence[TextInput], direction: str = "right") -> list[tuple[Tokens, Encoding, int]]:
        """Like ``tokens``, each with its ``tokenizers`` Encoding (offsets, special tokens, word ids: what tagging reads)
        and the shift that makes its offsets point into the input's own text (not 0 when "left" cut its start)."""
        encs = self._pick(self._unpadded, direction).encode_batch([self._item(i, direction) for i in inputs])
        out = []
        for i, e, cut in zip(inputs, encs, self.cut(inputs), strict=True):
            shift = max(0, len(i.text) - self.max_chars) if direction == "left" else 0
            tokens = Tokens(
                np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64), len(e.overflowing) > 0 or cut
            )
            out.append((tokens, e, shift))
        return out

    def tokens(self, inputs: Sequence[TextInput], direction: str = "right") -> list[Tokens]:
        """Each input's tokens, truncated like ``encode`` but not padded (``pad`` makes a batch of them)."""
        encs = self._pick(self._unpadded, direction).encode_batch([self._item(i, direction) for i in inputs])
        return [
            Tokens(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64), len(e.overflowing) > 0 or cut)
            for e, cut in zip(encs, self.cut(inputs), strict=True)
        ]

    @staticmethod
    def _pick(tokenizers: dict[str, Tokenizer], direction: str) -> Tokenizer:
        tok = tokenizers.get(direction)
        if tok is None:
            raise ValueError(f"truncation direction {direction!r} is not known; allowed: {', '.join(TRUNCATION_DIRECTIONS)}")
        return tok

    def _item(self, i: TextInput, direction: str = "right") -> str | tuple[str, str]:
        """The input as the tokenizer takes it, each text cut at ``max_chars`` characters: its first ones, or with
        ``direction`` "left" its last ones (the side truncation keeps)."""
        keep = slice(-self.max_chars, None) if direction == "left" else slice(None, self.max_chars)
        text = i.text[keep]
        return text if i.text_pair is None else (text, i.text_pair[keep])

    def pad(self, rows: Sequence[Tokens], length: int | None = None) -> Encoded:
        """``rows`` as one batch padded on the right to ``length`` (default: the longest row): what ``encode`` gives
        for the same inputs. Raises ValueError for no rows or a ``length`` shorter than a row."""
        if not rows:
            raise ValueError("nothing to pad")
        longest = max(r.length for r in rows)
        width = longest if length is None else length
        if width < longest:
            raise ValueError(f"cannot pad a row of {longest} tokens to {width}")
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)  # (batch, seq)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        types = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : r.length] = r.ids
            mask[i, : r.length] = 1
            types[i, : r.length] = r.type_ids
        return Encoded(ids, mask, types, [r.truncated for r in rows])

    def pad_to(self, encoded: Encoded, length: int) -> Encoded:
        """``encoded`` padded on the right to ``length`` tokens (pad id, mask 0, segment 0); the same object when it
        is that long already. Raises ValueError when ``length`` is shorter than the batch."""
        seq = encoded.input_ids.shape[1]
        if length < seq:
            raise ValueError(f"cannot pad a batch of {seq} tokens to {length}")
        if length == seq:
            return encoded
        widths = ((0, 0), (0, length - seq))
        return replace(
            encoded,
            input_ids=np.pad(encoded.input_ids, widths, constant_values=self.pad_id),
            attention_mask=np.pad(encoded.attention_mask, widths),
            token_type_ids=np.pad(encoded.token_type_ids, widths),
        )


def bucket_lengths(max_length: int, buckets: int | Sequence[int]) -> tuple[int, ...]:
    """The lengths batches get padded to: every multiple of ``buckets`` (an int) or the given lengths, those under
    ``max_length``, then ``max_length`` itself. ``buckets`` = 0 means no bucketing: an empty tuple.

    Raises FusionServeError for a negative size, an empty list or a length below 1."""
    if isinstance(buckets, bool) or not isinstance(buckets, (int, Sequence)):
        raise FusionServeError(f"seq_buckets must be an int >= 0 or a list of lengths, got {buckets!r}")
    if isinstance(buckets, int):
        if buckets < 0:
            raise FusionServeError(f"seq_buckets = {buckets} is out of range; allowed: 0 (off) or a bucket size >= 1")
        if buckets == 0:
            return ()
        lengths = set(range(buckets, max_length, buckets))
    else:
        if not buckets or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in buckets):
            raise FusionServeError(f"seq_buckets = {list(buckets)!r}: the lengths must be ints >= 1, at least one")
        lengths = {n for n in buckets if n < max_length}
    return (*sorted(lengths), max_length)


def bucket_length(seq_len: int, lengths: tuple[int, ...]) -> int:
    """The first of ``lengths`` (ascending, see ``bucket_lengths``) that holds ``seq_len`` tokens; ``seq_len``
    itself when there are no buckets or none is long enough."""
    i = bisect.bisect_left(lengths, seq_len)
    return lengths[i] if i < len(lengths) else seq_len
