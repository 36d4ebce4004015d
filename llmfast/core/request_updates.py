"""A step's sampled tokens appended to their requests: placeholders filled, stop
conditions checked, one `RequestUpdate` per request for the engine's output stream.

With async scheduling the output may be one step older than the last schedule (see
core/scheduler.py): a request finished or aborted since, or a later one reusing its id,
takes nothing; one preempted since still takes its token (it was computed from the
right inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmfast.core.request import Request, RequestStatus
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to a request, for the engine's output stream."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # None while the request keeps running
    # Per new token: (logprob of the sampled token, {token: logprob} top-n), if asked.
    logprobs: list[tuple[float, dict[int, float]]] | None = None


def _append_token(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Append one sampled token to `request`; the status it finishes with, if any: a stop
    token past min_tokens, else max_tokens or the model's length reached."""
    out_ids = request.output_token_ids
    out_ids.append(token)
    request.all_token_ids.append(token)
    num_out = len(out_ids)
    if token in request.stop_token_set and num_out > request.min_tokens:
        return _STOPPED
    if num_out >= request.max_tokens or len(request.all_token_ids) >= max_model_len:
        return _LENGTH
    return None


def append_sampled_tokens(
    requests: dict[str, Request], scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput, max_model_len: int,
) -> tuple[list[RequestUpdate], list[tuple[Request, RequestStatus]]]:
    """Append each request's sampled tokens (up to the first that finishes it); the
    updates, and the requests that finished with their status (still in `requests`,
    holding their blocks: the caller retires them)."""
    step_index = scheduler_output.step_index
    all_logprobs = model_runner_output.logprobs
    updates: list[RequestUpdate] = []
    finished: list[tuple[Request, RequestStatus]] = []
    for idx, (rid, sampled) in enumerate(
        zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)
    ):
        # A prefill chunk short of the prompt's end samples nothing.
        if not sampled:
            continue
        request = requests.get(rid)
        # Gone (finished or aborted since schedule), or a later request reusing the id.
        if request is None or request.first_step > step_index:
            continue
        # One sampling step fills one placeholder, however many tokens it yields.
        if request.num_output_placeholders < 1:
            raise RuntimeError(f"request {rid}: a token arrived that was never scheduled")
        request.num_output_placeholders -= 1
        if len(sampled) == 1:  # a decode step's one token: the loop below, unrolled
            status = _append_token(request, sampled[0], max_model_len)
            new_ids = sampled
            num_accepted = 1
        else:
            status = None
            num_accepted = 0
            for token in sampled:
                num_accepted += 1
                status = _append_token(request, token, max_model_len)
                if status is not None:
                    break
            new_ids = sampled if num_accepted == len(sampled) else sampled[:num_accepted]
        logprobs = None if all_logprobs is None else all_logprobs[idx][:num_accepted]
        if status is None:
            updates.append(RequestUpdate(rid, new_ids, None, logprobs))
        else:
            updates.append(RequestUpdate(rid, new_ids, status.finish_reason, logprobs))
            finished.append((request, status))
    return updates, finished
