"""A launched step's sampled ids on their way to the host, without stalling the device.

`OutputCopier.copy` queues one non-blocking device-to-host copy of the step's sampled ids
(and logprobs and prompt logprobs, when asked) on a side stream, into pinned memory, and records an event.
The host waits on that event only in `PendingStep.wait`, when it needs the values to
emit outputs; meanwhile it may schedule and launch the next step. Two pinned buffers
alternate: step N+1's copy is queued before the host reads step N's buffer.

On a CPU device the "copy" is a plain copy of values that already exist (the forward ran
synchronously), so the same code path runs, with nothing to wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmfast.core.scheduler_output import PromptLogprobsChunk
from llmfast.worker.sampling.prompt_logprobs import PromptSpan, unpack_prompt_logprobs
from llmfast.worker.sampling.sampler import LogprobsTensors


@dataclass
class PendingStep:
    """What the host must remember of a launched step to read its outputs later: the
    batch rows change (and requests come and go) before that happens."""

    req_ids: list[str]  # scheduled rows, in row order
    samples: list[bool]  # per scheduled row: whether it sampled
    sampled_host: torch.Tensor  # [num_rows] int64 on the host (pinned on CUDA); per row
    logprobs_host: LogprobsTensors | None  # per row, when any row asked for logprobs
    num_logprobs: list[int | None] | None  # per scheduled row: top-n asked for
    rows: list[int]  # the scheduled rows' indices at launch (index sampled_host)
    # Runner state of each sampling row, its row at launch (indexes sampled_host) and the
    # column its placeholder sits in, to write the value into the batch row once known
    # (the state object tells a reused id apart). Arrays: one fancy assignment.
    sampling_states: list[object]
    sampling_rows: np.ndarray
    placeholder_cols: np.ndarray
    event: torch.cuda.Event | None
    sampled_device: torch.Tensor  # kept alive until the copy is read
    # Packed prompt logprobs on the host (prompt_logprobs.py) and whose rows they are,
    # when a request scored prompt tokens this step.
    prompt_logprobs_host: torch.Tensor | None = None
    prompt_spans: list[PromptSpan] | None = None
    # InputBatch.version at launch: unchanged at collect, the rows are the launch's.
    batch_version: int = -1
    # Speculative decoding's verify step: sampled_host holds [num_rows, spec_width]
    # (per row: its number of emitted tokens, then the tokens); 0 for a plain step.
    spec_width: int = 0
    # Speculative decoding with a draft model: the step's tensors it catches up from
    # (spec_decode/proposer.py's StepTensors).
    spec_step: object | None = None
    # ... and the step's sampling metadata, when some row samples at random (the draft
    # model then samples its drafts likewise and returns their distributions).
    spec_sampling: object | None = None

    def wait(self) -> np.ndarray:
        """Block until the copy has landed; the sampled ids per row at launch."""
        if self.event is not None:
            self.event.synchronize()
        return self.sampled_host.numpy()

    def collect_logprobs(self) -> list[list[tuple[float, dict[int, float]]]]:
        """Per scheduled row: [(sampled token's logprob, {top id: logprob})] where the row
        sampled and asked for logprobs, else []. Reads the host copy: after `wait`."""
        lp = self.logprobs_host
        sampled_lp = lp.sampled_logprobs.numpy()
        top_ids, top_lps = lp.topk_ids.numpy(), lp.topk_logprobs.numpy()
        result: list[list[tuple[float, dict[int, float]]]] = []
        for r, sampled_here, want in zip(self.rows, self.samples, self.num_logprobs):
            if not sampled_here or want is None:
                result.append([])
                continue
            top = {int(i): float(v) for i, v in zip(top_ids[r, :want], top_lps[r, :want])}
            result.append([(float(sampled_lp[r]), top)])
        return result

    def collect_prompt_logprobs(self) -> dict[str, PromptLogprobsChunk] | None:
        """Per request that scored prompt tokens this step: its chunk. After `wait`."""
        if self.prompt_logprobs_host is None:
            return None
        return unpack_prompt_logprobs(self.prompt_logprobs_host.numpy(), self.prompt_spans)


class OutputCopier:
    def __init__(self, max_num_reqs: int, device: torch.device, width: int = 1) -> None:
        """`width`: ids per row at most (speculative decoding's verify step: K + 2)."""
        self.device = device
        cuda = device.type == "cuda"
        self._host = [torch.zeros(max_num_reqs * width, dtype=torch.int64, pin_memory=cuda)
                      for _ in range(2)]
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self._next = 0

    def copy(self, sampled: torch.Tensor, logprobs: LogprobsTensors | None,
             prompt_logprobs: torch.Tensor | None = None) -> dict:
        """Queue the copy of `sampled` [n] or [n, width] (and `logprobs`,
        `prompt_logprobs`) to the host; returns `PendingStep`'s fields for the host
        tensors (valid once the event has completed) and the event."""
        slot = self._next
        self._next ^= 1
        host = self._host[slot][: sampled.numel()].view(sampled.shape)
        if self._stream is None:
            host.copy_(sampled)
            return {"sampled_host": host, "logprobs_host": logprobs,
                    "prompt_logprobs_host": prompt_logprobs, "event": None}
        # The side stream starts after the sampler's kernels, without the host waiting.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(sampled, non_blocking=True)
            logprobs_host = None
            if logprobs is not None:  # .to(cpu, non_blocking) lands in pinned memory
                logprobs_host = LogprobsTensors(
                    *(t.to("cpu", non_blocking=True) for t in logprobs))
                for t in logprobs:
                    t.record_stream(self._stream)
            prompt_host = None
            if prompt_logprobs is not None:
                prompt_host = prompt_logprobs.to("cpu", non_blocking=True)
                prompt_logprobs.record_stream(self._stream)
            event = self._events[slot]
            event.record(self._stream)
        # The sampler's output is used on the side stream: its memory must not be reused
        # by the main stream's allocations until the copy is done.
        sampled.record_stream(self._stream)
        return {"sampled_host": host, "logprobs_host": logprobs_host,
                "prompt_logprobs_host": prompt_host, "event": event}
