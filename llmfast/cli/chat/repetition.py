"""A reply caught in a loop: its last tokens are one block of tokens repeated.

A small model sampled at a low temperature can fall into a loop ("Paris is the capital.
Paris is the capital. ...") and, left alone, runs to max_tokens. `repeating_period`
looks at the tail only (a fixed window, whatever the reply's length) with one numpy
comparison of the window against itself shifted by every period at once, so the check
per step costs the same at token 10 and token 10,000.

Worked example, repeats=3, max_period=4: for the tail `... 7 8 9 | 5 6 5 6 5 6`, the
window compared with itself shifted by 2 matches over the last 4 positions (each token
equals the one 2 before it), i.e. period 2 repeated 3 times: a loop of period 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_PERIOD = 64  # the longest repeated block looked for, in tokens
MIN_SPAN = 32  # a loop covers at least this many tokens (`\n\n\n` or `----` are not loops)


def repeating_period(token_ids: Sequence[int], repeats: int, max_period: int = MAX_PERIOD,
                     min_span: int = MIN_SPAN) -> int | None:
    """The smallest period p such that the last max(p * repeats, min_span) tokens are one
    block of p tokens repeated (p * repeats tokens at least), or None. repeats < 2: None."""
    if repeats < 2:
        return None
    periods = np.arange(1, max_period + 1)  # [P]
    spans = np.maximum(periods * repeats, min_span)  # tokens each period must cover
    window = min(len(token_ids), int(spans[-1]))
    if window < min_span:
        return None
    tail = np.asarray(token_ids[len(token_ids) - window:], dtype=np.int64)  # [W]
    # Row p - 1 of `shifted` is the window moved right by p, -1 filling its start (a view,
    # no copy): same[p - 1, i] is tail[i] == tail[i - p], False where i < p.  # [P, W]
    padded = np.concatenate((np.full(max_period, -1, dtype=np.int64), tail))
    shifted = np.lib.stride_tricks.sliding_window_view(padded, window)[max_period - 1::-1]
    same = shifted == tail
    # How many of the last positions match, per period: the run of True at each row's end.
    mismatch = ~same[:, ::-1]
    run = np.where(mismatch.any(axis=1), mismatch.argmax(axis=1), window)  # [P]
    # Period p repeated over a span s: the last s - p tokens each equal the one p before.
    hits = (run >= spans - periods) & (spans <= window)
    return int(periods[hits.argmax()]) if hits.any() else None
