"""The packer of jspec.bench.attention: one document-length distribution for a whole
scaling series, so rows of different lengths (and every cp) do the same attention work per token."""

import numpy as np

from jspec.bench.attention import ALIGN, packed_rows


def _documents(seg, pos):
    """Lengths of the documents of each row, and whether each one was cut at the row end."""
    lengths, cut = [], []
    for s, p in zip(seg, pos, strict=True):
        starts = np.flatnonzero(p == 0)
        assert (s[starts] == np.arange(1, len(starts) + 1)).all()  # one id per document, in order
        sizes = np.diff(np.append(starts, len(s)))
        lengths += list(sizes)
        cut += [False] * (len(sizes) - 1) + [True]
    return np.array(lengths), np.array(cut)


def test_packed_rows_one_distribution_for_every_row_length():
    mean_doc = 16 * ALIGN
    for seq in (64 * ALIGN, 256 * ALIGN):
        seg, pos = packed_rows(8, seq, mean_doc, ALIGN, np.random.default_rng(0))
        assert seg.shape == pos.shape == (8, seq)
        lengths, cut = _documents(seg, pos)
        assert (lengths % ALIGN == 0).all()  # every cp up to 8 can shard every document
        assert lengths[~cut].max() <= (2 * mean_doc // ALIGN - 1) * ALIGN
        assert abs(lengths[~cut].mean() / mean_doc - 1) < 0.15
