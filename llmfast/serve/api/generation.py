"""One completion or chat request through the engine: queue it, then stream SSE chunks or
collect the whole response. Whatever way the HTTP request ends early (client gone,
shutdown, error), its engine requests are aborted on the spot, which frees their KV blocks
before the next step."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmfast.serve.api.errors import APIError, error_body
from llmfast.serve.api.metrics import RequestTracker, ServerMetrics
from llmfast.serve.api.responses import Kind, ResponseBuilder
from llmfast.serve.api.sampling import EngineInputs
from llmfast.serve.api.sse import DONE, event
from llmfast.serve.frontend_types import (
    ContextLengthExceeded,
    DeltaQueue,
    EngineFront,
    EngineUnavailable,
    PreparedPrompt,
    StreamError,
    merged_in_order,
)
from llmfast.utils.errors import one_line

# HTTP status for a response nobody will read (nginx's "client closed request").
CLIENT_CLOSED = 499


async def run_generation(request: Request, front: EngineFront, metrics: ServerMetrics,
                         kind: Kind, model: str, inputs: EngineInputs, *, stream: bool,
                         include_usage: bool, echo: bool = False, want_logprobs: bool = False,
                         want_prompt_logprobs: bool = False) -> Response:
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    rs = DeltaQueue(f"{prefix}-{uuid.uuid4().hex}", len(inputs.params))
    # From before the add: its tokenising and (for many choices) its slices are waited for.
    tracker = metrics.tracker(len(inputs.params))
    prepared = await _submit(front, rs, inputs, kind, with_text=echo)
    metrics.prompt_tokens.inc(sum(len(p.token_ids) for p in prepared))
    builder = ResponseBuilder(kind, rs.request_id, model, prepared, inputs.n, echo=echo,
                              want_logprobs=want_logprobs,
                              want_prompt_logprobs=want_prompt_logprobs,
                              scoring_only=inputs.scoring_only, tools=inputs.tools)
    if stream:
        return StreamingResponse(
            _events(front, metrics, rs, builder, tracker, include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        done = await _until_disconnect(request, _collect(rs, builder, tracker))
    finally:
        _abort_unfinished(front, metrics, rs, builder)
    if not done:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(builder.response())


async def _submit(front: EngineFront, rs: DeltaQueue, inputs: EngineInputs, kind: Kind,
                  with_text: bool) -> list[PreparedPrompt]:
    param = "prompt" if kind == "completion" else "messages"
    try:
        return await front.add(rs, inputs.prompts, inputs.params, with_text=with_text,
                               check_length=inputs.max_tokens_given)
    except EngineUnavailable as e:
        # The add may still reach the engine (sent just before the front stopped).
        front.abort(rs.engine_ids)
        raise APIError(str(e), 503) from None
    except ContextLengthExceeded as e:  # OpenAI's code for it
        raise APIError(str(e), 400, param, "context_length_exceeded") from None
    except ValueError as e:  # RequestRejected, TokenizerError, a prompt the engine refuses
        raise APIError(one_line(e, max_chars=None), 400, param) from None
    except BaseException:
        front.abort(rs.engine_ids)  # cancelled while queued: the add may still happen
        raise


async def _collect(rs: DeltaQueue, builder: ResponseBuilder, tracker: RequestTracker
                   ) -> None:
    while not builder.done:
        item = await rs.get()
        if isinstance(item, StreamError):
            raise APIError(item.message, item.status)
        tracker.on_delta(item)
        builder.add_text(item)


async def _until_disconnect(request: Request, work) -> bool:
    """Run `work`; False if the client disconnected first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():  # the client left: let the collector unwind
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()  # re-raises an APIError from the stream
    return True


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(front: EngineFront, metrics: ServerMetrics, rs: DeltaQueue,
                  builder: ResponseBuilder, tracker: RequestTracker,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE text. Deltas that queued up while the client was being written to go out in
    one write, those of one choice merged into one chunk (`merged_in_order`; not a
    completion's with logprobs): a lagging stream costs a chunk per choice and write,
    not one per token. Cancelled when the client disconnects; the finally aborts."""
    try:
        head = "".join(event(c) for c in builder.first_chunks())
        if head:
            yield head
        # A completion's logprobs carry text offsets: those deltas stay one chunk each.
        merge_logprobs = not (builder.kind == "completion" and builder.want_logprobs)
        while not builder.done:
            parts = []
            for item in merged_in_order(await rs.get_ready(), merge_logprobs):
                if isinstance(item, StreamError):
                    yield "".join(parts) + event(error_body(item.message, item.status)) + DONE
                    return
                tracker.on_delta(item)
                chunk = builder.chunk(item)
                if chunk is not None:
                    parts.append(event(chunk))
                if builder.done:
                    break
            if parts:
                yield "".join(parts)
        yield (event(builder.usage_chunk()) if include_usage else "") + DONE
    finally:
        _abort_unfinished(front, metrics, rs, builder)


def _abort_unfinished(front: EngineFront, metrics: ServerMetrics, rs: DeltaQueue,
                      builder: ResponseBuilder) -> None:
    """A response that ends before its last delta (the client left, an error): its
    engine requests are aborted and counted."""
    if not builder.done:
        front.abort(rs.engine_ids)
        metrics.aborted.inc()
