"""What `LLM.generate` and the streaming API return (vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field


# slots: one of each per streaming request and step; created and freed faster.
@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # all output text so far (stop string excluded)
    token_ids: list[int]  # all output ids; grows in place until the request finishes
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that hit
    # Per generated token: {token id: logprob} (sampled token first, then the top-n).
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""  # text added by the latest step (streaming)
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing
    # precedes it), then {token id: logprob}: the prompt token's own first, then the
    # top-n others (float32 log-softmax of the raw logits, as vLLM's).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The same tokens' ranks in their distributions (1 = the most likely; None first).
    prompt_logprob_ranks: list[int | None] | None = None


class GenerationInterrupted(KeyboardInterrupt):
    """`LLM.generate` (or `chat`) stopped by Ctrl-C: what had finished is not lost.
    `outputs` is in input order, the RequestOutput of each prompt that finished before
    the interrupt and None for the others (aborted, their KV blocks freed)."""

    def __init__(self, outputs: list[RequestOutput | None]) -> None:
        super().__init__(f"{sum(o is not None for o in outputs)} of {len(outputs)} "
                         "completions finished")
        self.outputs = outputs
