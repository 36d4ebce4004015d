"""N-gram prompt lookup: drafts copied from the request's own history, no model.

For each row, the longest suffix of its known tokens (between `min_n` and `max_n`
tokens) that also occurs earlier in the row is looked up; the tokens that followed its
most recent earlier occurrence become the drafts (at most K, and never past the
history's end). Text that copies or edits its context (code edits, quoting, a repeated
paragraph) is thereby drafted for free.

Vectorised over the batch: for each j < max_n (a loop of max_n steps, not over tokens),
`eq[j][r, p]` says whether token p - j of row r equals the row's token num_tokens - 1 - j;
the number of leading True in eq[0..][r, p] is the length of the match that ends at
position p. Worked example, one row [5 7 9 5 7 9 5 7] (num_tokens 8), min_n 2, max_n 3:
the suffix is [9 5 7] read backwards from position 7 -> [7, 5, 9];
    p        = 0 1 2 3 4 5 6 (positions before the last)
    eq[0]    = 0 1 0 0 1 0 0   (token p == 7)
    eq[1]    = 0 1 0 0 1 0 0   (token p-1 == 5; p = 0 has no p-1)
    eq[2]    = 0 0 0 0 1 0 0   (token p-2 == 9)
    match    = 0 2 0 0 3 0 0
the longest match (3) ends at p = 4, so the drafts are tokens 5.. = [9 5 7] (K = 3).
"""

from __future__ import annotations

import numpy as np

from llmfast.worker.spec_decode.proposer import Drafts, ProposalInputs, Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        super().__init__(num_speculative_tokens)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, inputs: ProposalInputs) -> Drafts:
        n = len(inputs.req_ids)
        k = self.num_speculative_tokens
        token_ids = np.full((n, k), -1, dtype=np.int64)
        num_drafts = np.zeros(n, dtype=np.int32)
        rows = np.flatnonzero((inputs.max_num_drafts[:n] > 0)
                              & (inputs.num_tokens[:n] > self.min_n))
        if len(rows):
            ids, counts = propose_ngram(inputs.token_ids[rows], inputs.num_tokens[rows],
                                        inputs.max_num_drafts[rows], self.min_n, self.max_n, k)
            token_ids[rows] = ids
            num_drafts[rows] = counts
        return Drafts(token_ids, num_drafts)


def propose_ngram(token_ids: np.ndarray, num_tokens: np.ndarray, max_num_drafts: np.ndarray,
                  min_n: int, max_n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for m rows (the module doc's rule).

    token_ids [m, >= max(num_tokens)] (padded past each row's num_tokens), num_tokens [m],
    max_num_drafts [m] (each <= k). Returns (drafts [m, k] int64 padded with -1,
    num_drafts [m] int32)."""
    m = len(num_tokens)
    length = int(num_tokens.max())
    tokens = token_ids[:, :length].astype(np.int64)  # [m, L]
    last = num_tokens.astype(np.int64) - 1  # [m] the suffix's end
    rows = np.arange(m)[:, None]
    positions = np.arange(length)[None, :]  # [1, L] candidate match ends
    # Ends strictly before the suffix's own end: the match must have a continuation.
    valid = positions < last[:, None]  # [m, L]
    match = np.zeros((m, length), dtype=np.int64)
    still = valid.copy()  # matching through offsets 0..j so far
    for j in range(max_n):
        target = tokens[rows[:, 0], np.maximum(last - j, 0)]  # [m] suffix token j back
        src = positions - j
        eq = (src >= 0) & (last[:, None] - j >= 0)
        eq &= tokens[rows, np.maximum(src, 0)] == target[:, None]
        still &= eq
        match += still
    match = np.where(match >= min_n, match, 0)
    # Longest match, then the latest end: one argmax of match * L + position.
    score = np.where(match > 0, match * length + positions, -1)
    best = score.argmax(axis=1)  # [m]
    found = score[np.arange(m), best] >= 0
    # Continuation: tokens best+1 .. best+k, not past the last known token.
    counts = np.minimum(np.minimum(last - best, k), max_num_drafts).astype(np.int32)
    counts = np.where(found, np.maximum(counts, 0), 0).astype(np.int32)
    cols = best[:, None] + 1 + np.arange(k)[None, :]  # [m, k]
    drafts = tokens[rows, np.minimum(cols, length - 1)]
    drafts = np.where(np.arange(k)[None, :] < counts[:, None], drafts, -1)
    return drafts, counts
