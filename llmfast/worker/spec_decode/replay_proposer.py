"""A proposer that replays known continuations: the upper bound of speculation.

Given the full token sequences the requests will have (prompt then the target's own
greedy output, from a plain run), it proposes each row's next tokens from the sequence
its known tokens start, so every draft is accepted (up to numerical ties between the
verify step's and the plain step's logits). Benchmarks measure the verify step's best
case with it; tests check that full acceptance emits exactly the target's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llmfast.worker.spec_decode.proposer import Drafts, ProposalInputs, Proposer


class ReplayProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, sequences: Sequence[Sequence[int]]) -> None:
        super().__init__(num_speculative_tokens)
        # Looked up by their first tokens (a row's prompt starts its sequence): the
        # shortest prefix that tells the sequences apart is not needed, every sequence is
        # tried until one matches (a benchmark's few requests, not a hot path).
        self.sequences = [np.asarray(s, dtype=np.int64) for s in sequences]

    def propose(self, inputs: ProposalInputs) -> Drafts:
        n, k = len(inputs.req_ids), self.num_speculative_tokens
        ids = np.full((n, k), -1, dtype=np.int64)
        counts = np.zeros(n, dtype=np.int32)
        for r in np.flatnonzero(inputs.max_num_drafts[:n] > 0).tolist():
            known = inputs.token_ids[r, :inputs.num_tokens[r]]
            for seq in self.sequences:
                if len(seq) >= len(known) and np.array_equal(seq[:len(known)], known):
                    drafts = seq[len(known):len(known) + min(k, int(inputs.max_num_drafts[r]))]
                    ids[r, :len(drafts)] = drafts
                    counts[r] = len(drafts)
                    break
        return Drafts(ids, counts)
