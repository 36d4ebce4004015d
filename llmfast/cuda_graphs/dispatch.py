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


@dataclass(frozen=True)
class StepDispatch:
    descriptor: BatchDescriptor
    runner: RunnerKind
    num_reqs: int  # request rows the attention launch sees (padded under FULL)


def is_uniform_decode(num_scheduled: np.ndarray) -> bool:
    """Every request row of the step has exactly one query token.

    Rows with 0 tokens (in the batch, not scheduled this step) make it non-uniform:
    the full graph's rows are the tokens, one each."""
    return len(num_scheduled) > 0 and bool((num_scheduled == 1).all())


class GraphDispatcher:
    def __init__(self, mode: CudaGraphMode, capture_sizes: Sequence[int],
                 max_num_reqs: int, piecewise_sizes: Sequence[int] | None = None) -> None:
        """`piecewise_sizes`: the piecewise graphs' own sizes (None: capture_sizes)."""
        sizes = tuple(sorted(capture_sizes))
        self.mode = mode
        piecewise = sizes if piecewise_sizes is None else tuple(sorted(piecewise_sizes))
        self.piecewise_sizes = piecewise if mode.has_piecewise else ()
        # A uniform-decode step has at most max_num_reqs tokens: no use for larger graphs.
        self.full_sizes = tuple(s for s in sizes if s <= max_num_reqs) if mode.has_full else ()

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool) -> StepDispatch:
        if uniform_decode and num_tokens != num_reqs:
            raise ValueError(f"uniform decode with {num_tokens} tokens for {num_reqs} requests")
        if uniform_decode and self.full_sizes:
            padded = pad_num_tokens(num_tokens, self.full_sizes)
            if padded in self.full_sizes:
                return StepDispatch(BatchDescriptor(padded, True), RunnerKind.FULL, padded)
        if self.piecewise_sizes:
            padded = pad_num_tokens(num_tokens, self.piecewise_sizes)
            if padded in self.piecewise_sizes:
                return StepDispatch(BatchDescriptor(padded, uniform_decode),
                                    RunnerKind.PIECEWISE, num_reqs)
        return StepDispatch(BatchDescriptor(num_tokens, uniform_decode), RunnerKind.NONE, num_reqs)

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        return self.dispatch(num_tokens, num_tokens if uniform_decode else 0,
                             uniform_decode).descriptor.num_tokens
