"""One engine, many consumers: each request's outputs go to its own queue (`LLM`).

`LLMEngine.step()` advances every live request at once and returns all their outputs to
whoever called it. With several consumers on one engine (a `generate` call, open
`stream`s, other threads) the caller that steps must hand the others what belongs to
them. `OutputRouter` does that: every engine call runs under one lock; a consumer that
finds its queue empty takes the lock and steps (unless another consumer's step filled
the queue while it waited), and each output goes into the queue of the request it
belongs to. Outputs of requests that nobody here added (e.g. added on the engine
directly) are dropped.

A consumer that goes away (a stream closed or garbage-collected) is aborted at once when
it can be, else at the next engine call: a finaliser can run in the middle of an engine
call, on any thread, so it never touches the engine itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Self

from llmfast.outputs import RequestOutput
from llmfast.utils.progress import CountProgress


class OutputRouter:
    def __init__(self, engine) -> None:
        self.engine = engine
        # Reentrant so that a finaliser running inside an engine call on this thread can
        # take it and see `_busy` (and defer), instead of deadlocking.
        self._lock = threading.RLock()
        self._busy = False  # an engine call is in progress (under the lock)
        self._queues: dict[str, deque[RequestOutput]] = {}
        self._abandoned: deque[str] = deque()  # appended from anywhere, drained under the lock

    @contextlib.contextmanager
    def _engine_call(self) -> Iterator[object]:
        with self._lock:
            if self._busy:
                raise RuntimeError("re-entrant engine call (from a finaliser or callback)")
            self._busy = True
            try:
                self._abort_abandoned()
                yield self.engine
                self._abort_abandoned()
            finally:
                self._busy = False

    # ------------------------------------------------------------------ requests

    def add(self, prompts: Sequence, params: Sequence, stream: bool) -> list[str]:
        """Add requests, each with its own queue; all or none (a rejected one aborts
        those added before it)."""
        ids: list[str] = []
        with self._engine_call() as engine:
            try:
                for prompt, p in zip(prompts, params):
                    req_id = engine.add_request(prompt, p, stream=stream)
                    self._queues[req_id] = deque()
                    ids.append(req_id)
            except BaseException:
                for req_id in ids:
                    self._abort(req_id)
                raise
        return ids

    def release(self, req_ids: Sequence[str]) -> None:
        """The consumer is done with these requests: abort the unfinished ones now."""
        with self._engine_call():
            for req_id in req_ids:
                self._abort(req_id)

    def abandon(self, req_id: str, blocking: bool) -> None:
        """Abort a request whose consumer went away, now if the engine is free (waiting
        for it when `blocking`), else at the next engine call. Safe from finalisers."""
        self._abandoned.append(req_id)
        if not self._lock.acquire(blocking=blocking):
            return  # another thread is stepping; it aborts ours when its call ends
        try:
            if not self._busy:  # else: we interrupted our own thread's engine call
                self._busy = True
                try:
                    self._abort_abandoned()
                finally:
                    self._busy = False
        finally:
            self._lock.release()

    def _abort_abandoned(self) -> None:
        while self._abandoned:
            self._abort(self._abandoned.popleft())

    def _abort(self, req_id: str) -> None:
        if self._queues.pop(req_id, None) is not None:
            self.engine.abort(req_id)  # a finished request is unknown to it: a no-op

    # ------------------------------------------------------------------ outputs

    def next_output(self, req_id: str) -> RequestOutput:
        """The request's next output, stepping the engine until there is one."""
        queue = self._queues[req_id]
        while not queue:
            if self._queues.get(req_id) is not queue:
                raise StopIteration  # closed from another thread meanwhile
            self._step_unless(lambda: bool(queue), (req_id,))
        out = queue.popleft()
        if out.finished:
            with self._lock:
                self._queues.pop(req_id, None)
        return out

    def collect(self, req_ids: Sequence[str],
                on_step: CountProgress | None = None) -> list[RequestOutput]:
        """Run the requests to completion; their final outputs, in order."""
        final: dict[str, RequestOutput] = {}
        pending = list(req_ids)
        while True:
            still = []
            for req_id in pending:
                queue = self._queues[req_id]
                while queue:
                    out = queue.popleft()
                    if out.finished:
                        final[req_id] = out
                if req_id not in final:
                    still.append(req_id)
            pending = still
            if not pending:
                break
            queues = [self._queues[i] for i in pending]
            self._step_unless(lambda queues=queues: any(queues), pending)
            if on_step is not None:
                on_step(len(final), len(req_ids))
        with self._lock:
            for req_id in req_ids:
                self._queues.pop(req_id, None)
        return [final[i] for i in req_ids]

    def _step_unless(self, ready: Callable[[], bool], waiting_for: Sequence[str]) -> None:
        """Step the engine once and route its outputs, unless `ready()` turned true while
        this thread waited for the lock (another consumer's step served it)."""
        with self._engine_call() as engine:
            if ready():
                return
            if not engine.has_unfinished():
                raise RuntimeError(
                    f"request {waiting_for[0]!r} is no longer in the engine (aborted directly "
                    "on LLM.engine?)")
            for out in engine.step():
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.append(out)


class RequestStream(Iterator[RequestOutput]):
    """The outputs of one request, one per engine step that produced any.

    Closing it (or dropping the last reference to it) before the request finishes aborts
    the request and frees its KV blocks. While the request runs, `outputs[0].token_ids`
    of an output is the request's live list (it may already hold later tokens when the
    output was queued behind others); `delta_token_ids` and `delta_text` are the step's own.
    """

    def __init__(self, router: OutputRouter, request_id: str) -> None:
        self._router = router
        self.request_id = request_id
        self._done = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        try:
            out = self._router.next_output(self.request_id)
        except BaseException:
            self.close()
            raise
        if out.finished:
            self._done = True
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._router.abandon(self.request_id, blocking=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._done = True
            with contextlib.suppress(Exception):  # e.g. at interpreter shutdown
                self._router.abandon(self.request_id, blocking=False)
