"""The AVX2 instruction lq's int16 check models (the tests also run the real one: :mod:`bench._avx2`)."""

from __future__ import annotations

import numpy as np


def pmaddubsw_dot(a_u8: np.ndarray, w_s8: np.ndarray) -> int:
    """x86 ``vpmaddubsw`` then ``vpmaddwd`` along K: adjacent pairs saturate to int16, the rest is int32."""
    a = a_u8.astype(np.int64)
    w = w_s8.astype(np.int64)
    if a.size % 2:
        a, w = np.append(a, 0), np.append(w, 0)
    pairs = a[0::2] * w[0::2] + a[1::2] * w[1::2]
    return int(np.clip(pairs, -32768, 32767).sum())
