"""The token bitmask of structured outputs: per step, one row of 32-bit words per
request (bit t of a row allows token t), filled on the host by the requests' grammar
matchers and applied in the sampler, on the device, before anything else.

A step fills it in two halves around the forward launch, so the host's work overlaps
the device's (async scheduling stays on):
- `plan` (before the step's placeholders are recorded): the constrained rows that sample
  this step and the tokens each matcher has not accepted yet, read from the batch rows;
  the last one may be a placeholder, whose value the previous step still holds.
- `fill` (after the forward is queued): wait for the previous step's sampled ids if a
  placeholder needs them, advance the matchers, fill their rows in the persistent
  (pinned on CUDA) bitmask, every other row all ones, and queue one copy to the device.

Matchers live here, with the rows that see every token id; a request that leaves
(finished or preempted) drops its matcher, and a preempted one that comes back replays
its output tokens into a fresh matcher (the compiled grammar is cached): recompute needs
no rollback. A matcher whose grammar has ended (its stop token accepted) allows only the
stop tokens from then on: the request finishes on that token (the scheduler drops any
token an in-flight step computes for it), or with `ignore_eos` repeats it up to
max_tokens, and its text stays what the grammar accepted.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmfast.core.scheduler_output import SchedulerOutput
from llmfast.models.sources.model_source import ModelSource
from llmfast.structured.compiler import GrammarCache
from llmfast.structured_params import StructuredOutputs
from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.worker.input_batch import PLACEHOLDER_TOKEN_ID, InputBatch

if TYPE_CHECKING:  # xgrammar imports transformers: loaded at the first constraint only
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# Bits per bitmask word (int32, as xgrammar's kernels take it).
BITS = 32


@dataclass
class _RequestGrammar:
    compiled: Future  # of xgr.CompiledGrammar
    matcher: xgr.GrammarMatcher | None = None
    num_accepted: int = 0  # output tokens the matcher has taken
    broken: bool = False  # compile failed or a token was refused: no mask any more


@dataclass
class GrammarPlan:
    n: int  # the step's rows
    states: list[_RequestGrammar] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)  # the last may be a placeholder
    pending_src: list[int] = field(default_factory=list)  # its index in the last step's ids


def wants_grammar(out: SchedulerOutput) -> bool:
    """Whether a request `out` schedules for the first time has a constraint."""
    return any(new.sampling_params.structured is not None for new in out.scheduled_new_reqs)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens to -inf, in place, in one kernel (xgrammar's: Triton on CUDA,
    C++ on the CPU). logits [n, vocab_size] float32, bitmask [n, ceil(vocab / 32)] int32."""
    import xgrammar as xgr
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


class GrammarBitmask:
    def __init__(self, cache: GrammarCache, max_num_reqs: int, vocab_size: int,
                 device: torch.device) -> None:
        import xgrammar as xgr
        self.cache = cache
        self.words = -(-vocab_size // BITS)
        self.bitmask = CpuGpuBuffer(max_num_reqs, self.words, dtype=torch.int32, device=device)
        self.requests: dict[str, _RequestGrammar] = {}
        self._filler = xgr.BatchGrammarMatcher()
        # The row of an ended grammar: its stop tokens only.
        self._stop_row = np.zeros(self.words, dtype=np.uint32)
        for t in cache.stop_token_ids:
            self._stop_row[t // BITS] |= np.uint32(1 << (t % BITS))
        self._stop_row = self._stop_row.view(np.int32)
        # CUDA: the bitmask's copy, waited for before the host rewrites the pinned rows.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._copy_queued = False

    @classmethod
    def for_model(cls, source: ModelSource, eos_token_ids: tuple[int, ...], max_num_reqs: int,
                  device: torch.device) -> GrammarBitmask:
        """Made at the first constrained request: the tokenizer loads in the compile
        thread then (the worker has none of its own)."""
        vocab_size = source.config.vocab_size
        cache = GrammarCache(lambda: source.load_tokenizer().hf, vocab_size, eos_token_ids)
        return cls(cache, max_num_reqs, vocab_size, device)

    def add(self, req_id: str, spec: StructuredOutputs) -> None:
        """A request joins (or comes back after preemption): compile (or find) its grammar
        now, in a thread; its matcher is made when it first samples."""
        self.requests[req_id] = _RequestGrammar(self.cache.submit(spec))

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def update(self, out: SchedulerOutput) -> None:
        """Follow the step's requests: finished and preempted ones leave, new and resumed
        ones with a constraint join."""
        if self.requests:
            for req_id in out.finished_req_ids | out.preempted_req_ids:
                self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            if new.sampling_params.structured is not None:
                self.add(new.req_id, new.sampling_params.structured)

    def plan(self, batch: InputBatch, n: int, sampling_rows: np.ndarray) -> GrammarPlan | None:
        """The constrained rows sampling this step and their matchers' missing tokens;
        None when there are none. Call before the step's placeholders are recorded."""
        if not self.requests:
            return None
        samples = np.zeros(n, dtype=np.bool_)
        samples[sampling_rows] = True
        plan = GrammarPlan(n)
        index = batch.req_id_to_index
        for req_id, state in self.requests.items():  # the constrained requests only
            row = index.get(req_id)
            if row is None or row >= n or not samples[row] or state.broken:
                continue
            start = int(batch.num_prompt_tokens[row]) + state.num_accepted
            tokens = batch.token_ids[row, start:batch.num_tokens[row]].tolist()
            plan.states.append(state)
            plan.rows.append(row)
            plan.new_tokens.append(tokens)
            plan.pending_src.append(int(batch.pending_src[row])
                                    if tokens and tokens[-1] == PLACEHOLDER_TOKEN_ID else -1)
        return plan if plan.rows else None

    def fill(self, plan: GrammarPlan, last_sampled: np.ndarray | None) -> torch.Tensor:
        """The step's bitmask on the device, [n, words] int32. `last_sampled`: the previous
        step's sampled ids on the host (its `PendingStep.wait()`), needed when a row's
        last token is still a placeholder."""
        if self._copy_queued:
            self._copied.synchronize()
            self._copy_queued = False
        mask = self.bitmask.np
        mask[: plan.n] = -1  # all ones: the unconstrained rows' logits stay as they are
        matchers, rows = [], []
        for state, row, tokens, src in zip(plan.states, plan.rows, plan.new_tokens,
                                           plan.pending_src):
            if src >= 0:
                tokens[-1] = int(last_sampled[src])
            matcher = self._advance(state, tokens)
            if matcher is None:
                continue
            if matcher.is_terminated():
                mask[row] = self._stop_row
            else:
                matchers.append(matcher)
                rows.append(row)
        if matchers:
            self._filler.batch_fill_next_token_bitmask(matchers, self.bitmask.cpu, rows)
        device_mask = self.bitmask.copy_to_gpu(plan.n)
        if self._copied is not None:
            self._copied.record()
            self._copy_queued = True
        return device_mask

    def _advance(self, state: _RequestGrammar, tokens: list[int]) -> xgr.GrammarMatcher | None:
        import xgrammar as xgr
        if state.matcher is None:
            try:
                state.matcher = xgr.GrammarMatcher(state.compiled.result())
            except Exception as e:  # noqa: BLE001 - checked at the frontend; log, go on
                logger.error("a structured-output grammar failed to compile (%s: %s); the "
                             "request continues unconstrained", type(e).__name__, e)
                state.broken = True
                return None
        matcher = state.matcher
        for token in tokens:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                logger.error("the grammar refused token %d that its own mask allowed; the "
                             "request continues unconstrained", token)
                state.broken = True
                return None
        state.num_accepted += len(tokens)
        return matcher

    def shutdown(self) -> None:
        self.cache.shutdown()
