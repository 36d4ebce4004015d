"""Token-budget scheduler: chunked prefill, prefix caching, recompute preemption.

There is no prefill or decode phase. Each step every request gets tokens so that its
`num_computed_tokens` catches up to `num_tokens`: running requests first (in admission
order), then waiting ones in FIFO order, all under `max_num_batched_tokens` tokens and
`max_num_seqs` running requests. A prompt longer than the remaining budget is computed in
chunks over several steps. When the KV cache runs out, the most recently admitted running
request is preempted: its blocks are freed and it is recomputed later from scratch (its
full blocks usually come back as prefix-cache hits).

The engine calls, per step: `schedule()` -> runner -> `update()` -> (engine's stop-string
check) `finish_requests()`. Aborts and additions happen between steps. `update()` appends
the sampled tokens with core/request_updates.py and rolls back rejected drafts with
core/spec_decode.py.

With async scheduling the engine schedules step N+1 before `update()` has seen step N's
tokens. A request that samples in a step holds a placeholder for that token
(`Request.num_output_placeholders`) until the value arrives, so a decode in N+1 counts
N's token as there to compute. Stop conditions apply when values arrive, one step late:
a token sampled for a request that has finished since is dropped. A request whose last
allowed token (max_tokens) is a placeholder is not scheduled again.

Speculative decoding (synchronous loop only): a decoding request with drafts
(`Request.spec_token_ids`, proposed by the runner after the last step) is scheduled
1 + K tokens (its last known token and the K drafts), counted in the token budget and
given KV slots like any other. After the step, `update()` rolls `num_computed_tokens`
back by the rejected drafts (their slots hold stale KV and are written again next
step), so only accepted tokens are ever computed, hashed or cached. Drafts are cut to
what the budget, max_model_len and max_tokens leave room for.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from llmfast.config import CacheConfig, SchedulerConfig
from llmfast.core.hybrid_kv_cache_manager import HybridKVCacheManager
from llmfast.core.kv_cache_groups import KVCacheGroups
from llmfast.core.kv_cache_manager import KVCacheManager
from llmfast.core.request import (
    Request,
    RequestRejected,
    RequestStatus,
    check_blocks_fit,
    check_prompt_length,
)
from llmfast.core.request_updates import RequestUpdate, append_sampled_tokens
from llmfast.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from llmfast.core.scheduler_stats import SchedulerStats
from llmfast.core.spec_decode import SpecDecodeCounts, apply_verify_results

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
# A running request's new block ids when it got none (most decode steps): one shared
# empty tuple instead of a list per request and step.
_NO_BLOCKS: tuple[int, ...] = ()
_REASON_TO_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
        sliding_window: int | None = None, num_lookahead_slots: int = 0, *,
        kv_groups: KVCacheGroups | None = None,
    ) -> None:
        """`sliding_window`: the window every layer of the model attends within, if one
        does (ModelConfig.kv_sliding_window): blocks that leave it are freed.
        `num_lookahead_slots`: KV slots past its scheduled tokens each decoding request
        gets (a draft-model proposer writes its drafts' KV there,
        worker/spec_decode/proposer.py).
        `kv_groups`: the model's KV-cache groups (core/kv_cache_groups.py); with more
        than one, each group has its own block list per request (its sliding groups
        free what left their windows) and block ids go to the runner per group."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # Several groups: the hybrid manager; one (every model but Gemma 3's kind): the
        # plain one, sliding or not.
        self.kv_groups = kv_groups if kv_groups is not None and kv_groups.num_groups > 1 \
            else None
        if self.kv_groups is not None:
            self.kv_cache_manager: KVCacheManager = HybridKVCacheManager(
                num_blocks, self.block_size, cache_config.enable_prefix_caching,
                self.kv_groups.windows)
        else:
            self.kv_cache_manager = KVCacheManager(
                num_blocks, self.block_size, cache_config.enable_prefix_caching,
                sliding_window)
        # A sequence can never be longer than the whole cache: treating that as the
        # length limit lets a request alone always make progress, so nothing starves.
        cache_capacity = self._cache_capacity(scheduler_config.max_model_len)
        self.max_model_len = min(scheduler_config.max_model_len, cache_capacity)
        self.requests: dict[str, Request] = {}  # unfinished ones, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; preemption takes the last
        # Ids the runner holds state for that finished or were aborted since last step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls so far; SchedulerOutput.step_index
        self.num_lookahead_slots = num_lookahead_slots
        self.spec_counts = SpecDecodeCounts()  # speculative decoding's, since start

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._check_fits(request)
        request.status = RequestStatus.WAITING
        request.first_step = self.num_steps
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise RequestRejected(f"request {rid!r}: a request with this id is already running")
        self.check_prompt_fits(len(request.all_token_ids))

    def _cache_capacity(self, upper: int) -> int:
        """The longest sequence (at most `upper` tokens) whose blocks the cache holds
        while it runs alone: every block once, or with several groups what
        KVCacheGroups.max_blocks_per_request counts (a step's chunk and the windows)."""
        usable = self.kv_cache_manager.num_usable_blocks
        if self.kv_groups is None:
            return usable * self.block_size
        return self.kv_groups.max_tokens(usable, self.max_num_batched_tokens,
                                         self.block_size, upper)

    def check_prompt_fits(self, n: int) -> None:
        """RequestRejected unless a prompt of `n` tokens can ever run: within
        max-model-len, and its KV blocks (with room for one more token) in the cache."""
        check_prompt_length(n, self.scheduler_config.max_model_len)
        if self.kv_groups is None:
            check_blocks_fit(n, self.block_size, self.kv_cache_manager.num_usable_blocks)
        elif self._cache_capacity(n + 1) < n + 1:
            raise RequestRejected(
                f"the prompt has {n} tokens; with room for one more its KV-cache blocks "
                f"over the model's {self.kv_groups.num_groups} KV-cache groups do not fit "
                f"in the cache's {self.kv_cache_manager.num_usable_blocks} blocks")

    def finish_requests(self, req_ids: str | Iterable[str], reason: str | RequestStatus) -> None:
        """End requests from outside (a stop string found by the engine, an abort).

        Unknown or already finished ids are ignored.
        """
        status = _REASON_TO_STATUS[reason] if isinstance(reason, str) else RequestStatus(reason)
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        finished: list[tuple[Request, RequestStatus]] = []
        for rid in req_ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                finished.append((request, status))
        self._retire(finished)

    def _retire(self, finished: list[tuple[Request, RequestStatus]]) -> None:
        """Give each finished request (already out of `self.requests`) its status: a
        running one frees its blocks and the runner drops its state; a waiting or
        preempted one (holds no blocks, the runner never kept it) leaves `waiting`."""
        stopped_running = False
        stopped_waiting: list[Request] = []
        for request, status in finished:
            if request.status is _RUNNING:
                self.kv_cache_manager.free(request)
                self.finished_req_ids.add(request.request_id)
                stopped_running = True
            else:
                stopped_waiting.append(request)
            request.status = status
        if stopped_running:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if len(stopped_waiting) == 1:  # (a scan up to it)
            self.waiting.remove(stopped_waiting[0])
        elif stopped_waiting:  # one pass, not one scan each: k of n would cost k x n
            kept = [r for r in self.waiting if not r.status.is_finished]
            self.waiting.clear()
            self.waiting.extend(kept)

    def abort(self, req_id: str) -> None:
        self.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        spec = self.spec_counts
        rate, length = spec.rates()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefix_cache_hit_rate=kv.stats.hit_rate,
            kv_cache_usage=kv.usage,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_num_verify_steps=spec.num_verify_steps,
            spec_acceptance_rate=rate,
            spec_mean_accepted_length=length,
        )

    # ---- one step ------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        # Free first: freeing caches the full blocks of the computed tokens.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken from the back of `running`, so pushing each to the front
        # of `waiting` keeps their admission order: running [A, B, C] losing C then B
        # gives waiting [B, C, ...].
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d times)", request.request_id, request.num_preemptions)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        cached = CachedRequestData()
        cached_ids, cached_blocks, cached_computed = (
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
        )
        new_reqs: list[NewRequestData] = []
        preempted_ids: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        lookahead = self.num_lookahead_slots
        allocate = self.kv_cache_manager.allocate_slots
        block_ids_of = self.kv_cache_manager.block_ids_of
        running = self.running
        # The last token of a sequence of max_model_len tokens is never computed.
        max_computed = self.max_model_len - 1

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + num_placeholders
            num_new = num_tokens - num_computed
            if num_placeholders and (
                len(request.output_token_ids) + num_placeholders >= request.max_tokens
            ):
                num_new = 0  # its last token is in flight: it finishes when that arrives
            drafts = request.spec_token_ids
            if drafts and num_new == 1:
                # A decode with drafts verifies them too: its last token and up to K
                # drafts, no more than max_tokens can still take (the step emits up to
                # one token past the accepted drafts).
                num_new += min(len(drafts),
                               request.max_tokens - len(request.output_token_ids) - 1)
            # min(num_new, budget, max_computed - num_computed), without the calls.
            if num_new > budget:
                num_new = budget
            if num_new > max_computed - num_computed:
                num_new = max_computed - num_computed
            if num_new <= 0:
                i += 1
                continue
            num_alloc = num_new
            if lookahead:
                num_alloc += min(lookahead, max_computed - num_computed - num_new)
            new_blocks = allocate(request, num_alloc)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
                new_blocks = allocate(request, num_alloc)
            if new_blocks is None:  # it preempted itself: nothing later can fit either
                break
            rid = request.request_id
            if drafts:
                # Consumed: the step's output brings the next ones.
                request.spec_token_ids = []
                num_drafts = num_computed + num_new - num_tokens
                if num_drafts > 0:
                    spec_tokens[rid] = drafts[:num_drafts]
            num_scheduled_tokens[rid] = num_new
            cached_ids.append(rid)
            cached_blocks.append(block_ids_of(new_blocks) if new_blocks else _NO_BLOCKS)
            cached_computed.append(num_computed)
            request.num_computed_tokens = num_computed + num_new
            if num_computed + num_new >= num_tokens:  # reaches the end: samples a token
                request.num_output_placeholders = num_placeholders + 1
            budget -= num_new
            i += 1

        # Admitting while preempting would only feed the thrashing.
        if not preempted_ids:
            budget = self._schedule_waiting(budget, num_scheduled_tokens, new_reqs)

        finished, self.finished_req_ids = self.finished_req_ids, set()
        self.num_steps += 1
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished,
            preempted_req_ids=preempted_ids,
            step_index=self.num_steps - 1,
            scheduled_spec_decode_tokens=spec_tokens,
        )

    def _schedule_waiting(
        self, budget: int, num_scheduled_tokens: dict[str, int], new_reqs: list[NewRequestData]
    ) -> int:
        kv = self.kv_cache_manager
        waiting, running = self.waiting, self.running
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            request = waiting[0]
            if request.num_output_placeholders:
                # Preempted with its last token in flight: the runner must get it whole.
                break
            computed_blocks, num_cached = kv.get_computed_blocks(request)
            num_tokens = len(request.all_token_ids)
            num_new = num_tokens - num_cached
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            num_alloc = num_new
            if self.num_lookahead_slots:  # (see the running loop)
                num_alloc += min(self.num_lookahead_slots,
                                 self.max_model_len - 1 - num_cached - num_new)
            if kv.allocate_slots(request, num_alloc, computed_blocks) is None:
                break  # FIFO: nothing behind it jumps the queue
            waiting.popleft()
            running.append(request)
            request.status = _RUNNING
            rid = request.request_id
            num_scheduled_tokens[rid] = num_new
            new_reqs.append(
                NewRequestData(
                    req_id=rid,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(rid),
                    num_computed_tokens=num_cached,
                )
            )
            request.num_computed_tokens = num_cached + num_new
            if num_cached + num_new == num_tokens:
                request.num_output_placeholders = 1
            budget -= num_new
        return budget

    def update(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        With one step in flight `scheduler_output` may be older than the last schedule:
        its tokens fill placeholders. A request preempted since still takes its token (it
        was computed from the right inputs); one finished or aborted since does not.
        """
        requests = self.requests
        if scheduler_output.scheduled_spec_decode_tokens or model_runner_output.spec_token_ids:
            apply_verify_results(requests, scheduler_output, model_runner_output,
                                 self.spec_counts)
        updates, finished = append_sampled_tokens(requests, scheduler_output,
                                                  model_runner_output, self.max_model_len)
        if finished:
            for request, _ in finished:
                del requests[request.request_id]
            self._retire(finished)
        return updates
