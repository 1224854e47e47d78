"""N-gram drafting (prompt lookup): a sequence's next tokens are guessed to be what followed the latest earlier
occurrence of its last n tokens, in its prompt or its output, for the longest n in [min, max] that occurs; the
latest occurrence with k tokens after it, where the latest has fewer (output that repeats itself, where the latest
occurrence overlaps the suffix and only the earlier ones can say k tokens ahead).

It costs no model and no device time, and it is right exactly where the output copies its input (code edits,
summaries and quotes, retrieval answers, tool-call arguments), which is much of what an agent generates.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last n tokens with k tokens
    after it (else the earliest: the most tokens after it), n from ``n_max`` down to ``n_min``; [] when none occurs."""
    length = len(tokens)
    if k <= 0 or length < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # candidates: every earlier position holding the last token (one comparison over the sequence), then the
    # longest n whose preceding tokens match too
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # i: tokens[i] == last token, i < length - 1
    if not len(ends):
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        hits = ends[ends >= n - 1]
        if n > 1 and len(hits):
            window = sliding_window_view(arr[:-1], n)[hits - n + 1]  # tokens[i - n + 1 : i + 1]
            hits = hits[(window == arr[length - n:]).all(axis=1)]
        if len(hits):
            full = hits[hits + k < length]
            start = int(full[-1] if len(full) else hits[0]) + 1
            return arr[start:start + k].tolist()
    return []
