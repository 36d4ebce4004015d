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
    for req_id, new_blocks, num_computed in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
    ):
        state = requests[req_id]
        state.block_ids.extend(new_blocks)
        state.num_computed_tokens = num_computed
        row = batch.req_id_to_index[req_id]
        batch.block_table.append_row(row, new_blocks)
        batch.num_computed_tokens[row] = num_computed
    for new in out.scheduled_new_reqs:
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
        )
        requests[new.req_id] = state
        batch.add_request(state)
    batch.condense()
