"""What crosses between the engine core and its clients: requests in, one message of
outputs per step out. msgspec structs: the in-process client passes them as they are, the
multi-process one encodes them as msgpack (array-like: no field names on the wire).

An `EngineCoreOutputs` holds a step's news as parallel lists, one entry per request that
got tokens (no Python object per token): the ids, the finish reasons of the requests that
ended, and, only for requests that asked, logprobs as plain lists.
"""

from __future__ import annotations

import enum

import msgspec

from llmfast.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the input processor has checked: it fits the model and the cache."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    client_index: int = 0  # which frontend gets its outputs (the multi-process client)


class StepStats(msgspec.Struct, array_like=True, gc=False):
    """The scheduler's statistics after a step (SchedulerStats' fields) and the step
    count: what /metrics reports."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    kv_cache_usage: float
    num_steps: int = 0
    # Speculative decoding, since start (SchedulerStats' spec_* fields).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_verify_steps: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's outputs. `req_ids[i]` got `new_token_ids[i]`; `finish_reasons` maps an
    index of `req_ids` to the reason its request ended ("stop", "length", "abort")."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    finish_reasons: dict[int, str] = msgspec.field(default_factory=dict)
    # Index -> (sampled token's logprob per new token, top-n ids per token, their
    # logprobs per token), only for requests that asked for logprobs.
    logprobs: dict[int, tuple[list[float], list[list[int]], list[list[float]]]] = \
        msgspec.field(default_factory=dict)
    # Request id -> a chunk of prompt logprobs: (first prompt index, logprob per token,
    # rank per token, top-n ids per token, their logprobs per token).
    prompt_logprobs: dict[str, tuple[int, list[float], list[int], list[list[int]],
                                     list[list[float]]]] = msgspec.field(default_factory=dict)
    # Requests scheduled for the first time since the last outputs: (id, prompt tokens
    # found in the prefix cache).
    scheduled: list[tuple[str, int]] = msgspec.field(default_factory=list)
    # Requests the core ended on its own without tokens (an error in the core): id ->
    # (message, HTTP status).
    errors: dict[str, tuple[str, int]] = msgspec.field(default_factory=dict)
    stats: StepStats | None = None


class ClientMessage(enum.IntEnum):
    """The first frame of a message from a client to the core process."""

    HELLO = 0  # payload: (client index, pid)
    ADD = 1  # payload: list[EngineCoreRequest]
    ABORT = 2  # payload: list[str]
    STOP_STRINGS = 3  # payload: list[str]: requests a stop string ended (finish "stop")


class CoreMessage(enum.IntEnum):
    """The first frame of a message from the core process to a client."""

    OUTPUTS = 0  # payload: EngineCoreOutputs
    FAILED = 1  # payload: str, why the core cannot step any more
    READY = 2  # payload: StepStats (the answer to HELLO)
