"""The shape grid parity is checked over: random token ids in padded batches of several sizes and sequence lengths.
numpy only, so that what checks a live artifact without PyTorch (``fusionserve tasks remove``) uses the same grid."""

from __future__ import annotations

import numpy as np

BATCH_SIZES = (1, 3, 8)
SEQ_LENS = (5, 37, 128)


def grid_inputs(
    vocab_size: int, max_seq_len: int, seed: int = 0, batch_sizes: tuple[int, ...] = BATCH_SIZES
) -> list[tuple[int, int, dict[str, np.ndarray]]]:
    """(batch, seq, inputs): random ids, every batch padded (rows of different lengths), pairs' second
    segment marked in token_type_ids."""
    rng = np.random.default_rng(seed)
    cases = []
    for batch in batch_sizes:
        for seq in (s for s in SEQ_LENS if s <= max_seq_len):
            ids = rng.integers(min(1000, vocab_size - 1) // 2, vocab_size, size=(batch, seq), dtype=np.int64)
            lengths = rng.integers(max(2, seq // 3), seq + 1, size=batch)
            lengths[0] = seq  # the longest row sets the width, as the tokenizer pads
            mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
            types = ((np.arange(seq)[None, :] >= lengths[:, None] // 2) & (mask == 1)).astype(np.int64)
            cases.append((batch, seq, {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}))
    return cases
