"""Which runner a step uses: the batch descriptor and the dispatch rule (pure, no torch).

A step is described by its padded token count and whether it is a *uniform decode*
(every scheduled request has exactly one query token). The rule, for the mode's sizes:

    uniform decode, padded size has a full graph    -> FULL: replay the whole forward
    else padded size has piecewise graphs           -> PIECEWISE: pieces replayed,
                                                       attention eager between them
    else                                            -> NONE: compiled, unpadded

A full graph's attention launch is fixed at capture, so it runs with as many request
rows as tokens: the padded rows are requests with no query token (query_start_loc
repeats, seq_len 0), whose programs exit at once. Piecewise and unpadded steps keep
the live request count.

Worked example, capture sizes (1, 2, 4, 8), max_num_seqs 4, mode full_and_piecewise:
    3 decodes            -> FULL at 4 tokens, 4 request rows (row 3 padding)
    3 tokens, 2 requests -> PIECEWISE at 4 tokens, 2 request rows
    6 decodes            -> PIECEWISE at 8 (full sizes stop at max_num_seqs = 4)
    9 tokens             -> NONE at 9

Speculative decoding's verify step (`spec_query_len` q = 1 + K): a step whose every
request has exactly q query tokens (each verifying K drafts) is a uniform step of query
length q, and runs as a full graph of its own kind at a size that is a multiple of q:
the capture sizes rounded up to multiples of q, at most max_num_seqs * q tokens and the
largest capture size. With q = 3 and the sizes above: verify sizes (3, 6) (1, 2 -> 3;
4 -> 6; 8 -> 9, past the largest size 8), so
    1 request verifying 2 drafts (3 tokens)       -> FULL at 3 tokens, 1 request row
    2 requests verifying 2 drafts each (6 tokens) -> FULL at 6, 2 rows
    3 such requests (9 tokens)                    -> NONE at 9 (past every size)
    1 request with 2 drafts and 1 plain decode    -> PIECEWISE at 4 (not uniform)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmfast.config import CudaGraphMode
from llmfast.cuda_graphs.sizes import pad_num_tokens


class RunnerKind(enum.Enum):
    FULL = "full"
    PIECEWISE = "piecewise"
    NONE = "none"  # compiled (or eager) without a graph


@dataclass(frozen=True)
class BatchDescriptor:
    num_tokens: int  # padded token count the forward runs at
    uniform_decode: bool
    # Query tokens per request of a uniform step (1: decode; 1 + K: a verify step); 0
    # when the step is not uniform.
    query_len: int = 0

    @property
    def graph_key(self) -> int | tuple[int, int]:
        """The full graph this step replays: a decode graph by its size, a verify graph
        by (size, query length)."""
        return self.num_tokens if self.query_len <= 1 else (self.num_tokens, self.query_len)


@dataclass(frozen=True)
class StepDispatch:
    descriptor: BatchDescriptor
    runner: RunnerKind
    num_reqs: int  # request rows the attention launch sees (padded under FULL)


def uniform_query_len(num_scheduled: np.ndarray) -> int:
    """The query length every request row of the step has (1: a uniform decode, 1 + K: a
    uniform verify step), or 0 if the rows differ (or one has no token)."""
    if not len(num_scheduled):
        return 0
    q = int(num_scheduled[0])
    return q if q > 0 and bool((num_scheduled == q).all()) else 0


def spec_full_sizes(capture_sizes: Sequence[int], query_len: int, max_num_reqs: int
                    ) -> tuple[int, ...]:
    """The verify graphs' sizes (the module doc): each capture size rounded up to a
    multiple of `query_len`, at most `max_num_reqs` requests' worth and never past the
    largest capture size."""
    if not capture_sizes:
        return ()
    limit = min(max_num_reqs * query_len, max(capture_sizes))
    rounded = {-(-s // query_len) * query_len for s in capture_sizes}
    return tuple(sorted(s for s in rounded if s <= limit))


def is_uniform_decode(num_scheduled: np.ndarray) -> bool:
    """Every request row of the step has exactly one query token.

    Rows with 0 tokens (in the batch, not scheduled this step) make it non-uniform:
    the full graph's rows are the tokens, one each."""
    return len(num_scheduled) > 0 and bool((num_scheduled == 1).all())


class GraphDispatcher:
    def __init__(self, mode: CudaGraphMode, capture_sizes: Sequence[int],
                 max_num_reqs: int, piecewise_sizes: Sequence[int] | None = None,
                 spec_query_len: int = 0) -> None:
        """`piecewise_sizes`: the piecewise graphs' own sizes (None: capture_sizes).
        `spec_query_len`: 1 + K under speculative decoding (verify graphs, module doc),
        else 0."""
        sizes = tuple(sorted(capture_sizes))
        self.mode = mode
        piecewise = sizes if piecewise_sizes is None else tuple(sorted(piecewise_sizes))
        self.piecewise_sizes = piecewise if mode.has_piecewise else ()
        # A uniform-decode step has at most max_num_reqs tokens: no use for larger graphs.
        self.full_sizes = tuple(s for s in sizes if s <= max_num_reqs) if mode.has_full else ()
        self.spec_query_len = spec_query_len if spec_query_len > 1 else 0
        self.spec_full_sizes = (spec_full_sizes(sizes, spec_query_len, max_num_reqs)
                                if mode.has_full and self.spec_query_len else ())

    @property
    def full_graph_keys(self) -> tuple[int | tuple[int, int], ...]:
        """Every full graph to capture: decode graphs by size, verify graphs by (size,
        query length) (BatchDescriptor.graph_key)."""
        return self.full_sizes + tuple((s, self.spec_query_len) for s in self.spec_full_sizes)

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                 query_len: int = 0) -> StepDispatch:
        """`query_len`: the step's uniform query length (`uniform_query_len`), when it is
        a verify step's 1 + K; a uniform decode says so by `uniform_decode` alone."""
        if uniform_decode and num_tokens != num_reqs:
            raise ValueError(f"uniform decode with {num_tokens} tokens for {num_reqs} requests")
        if (query_len > 1 and query_len == self.spec_query_len and self.spec_full_sizes
                and num_tokens == num_reqs * query_len):
            padded = pad_num_tokens(num_tokens, self.spec_full_sizes)
            if padded in self.spec_full_sizes:
                return StepDispatch(BatchDescriptor(padded, False, query_len), RunnerKind.FULL,
                                    padded // query_len)
        if uniform_decode and self.full_sizes:
            padded = pad_num_tokens(num_tokens, self.full_sizes)
            if padded in self.full_sizes:
                return StepDispatch(BatchDescriptor(padded, True, 1), RunnerKind.FULL, padded)
        if self.piecewise_sizes:
            padded = pad_num_tokens(num_tokens, self.piecewise_sizes)
            if padded in self.piecewise_sizes:
                return StepDispatch(BatchDescriptor(padded, uniform_decode),
                                    RunnerKind.PIECEWISE, num_reqs)
        return StepDispatch(BatchDescriptor(num_tokens, uniform_decode), RunnerKind.NONE, num_reqs)

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        return self.dispatch(num_tokens, num_tokens if uniform_decode else 0,
                             uniform_decode).descriptor.num_tokens
