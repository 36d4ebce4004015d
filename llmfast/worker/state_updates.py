"""Apply one SchedulerOutput's increments to the runner's per-request state and the
persistent batch rows: finished and preempted requests leave, running ones get their
new blocks and computed-token counts, new (or resumed) ones join; then the rows are
condensed to `0..num_reqs-1`."""

from __future__ import annotations

from llmfast.core.scheduler_output import SchedulerOutput
from llmfast.worker.input_batch import CachedRequestState, InputBatch


def update_states(requests: dict[str, CachedRequestState], batch: InputBatch,
                  out: SchedulerOutput) -> None:
    for req_id in out.finished_req_ids | out.preempted_req_ids:
        requests.pop(req_id, None)
        batch.remove_request(req_id)
    cached = out.scheduled_cached_reqs
    if cached.req_ids:
        # Vectorised: one fancy assignment for the computed counts; the per-request work
        # (state, block table) only for the few requests that got new blocks (a decode
        # step needs one every block_size steps).
        ids = cached.req_ids
        k = len(ids)
        if ids == batch.req_ids[:k]:  # rows 0..k-1 in order (no row moved): a slice
            rows = range(k)
            batch.num_computed_tokens[:k] = cached.num_computed_tokens
        else:
            index = batch.req_id_to_index
            rows = [index[req_id] for req_id in ids]
            batch.num_computed_tokens[rows] = cached.num_computed_tokens
        for i in [i for i, blocks in enumerate(cached.new_block_ids) if blocks]:
            new_blocks = cached.new_block_ids[i]
            state = requests[cached.req_ids[i]]
            if isinstance(new_blocks, tuple):  # several KV-cache groups: a list each
                for ids, new in zip(state.block_ids, new_blocks):
                    ids.extend(new)
            else:
                state.block_ids.extend(new_blocks)
            batch.block_table.append_row(rows[i], new_blocks)
    for new in out.scheduled_new_reqs:
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=(list(new.block_ids) if not isinstance(new.block_ids, tuple)
                       else [list(ids) for ids in new.block_ids]),
            num_computed_tokens=new.num_computed_tokens,
        )
        requests[new.req_id] = state
        batch.add_request(state)
    batch.condense()
