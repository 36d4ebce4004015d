"""`SamplingMetadata`, the sampler's per-step input, and its builder from the persistent
input batch, vectorised.

The per-request sampling arrays live in the batch (numpy + device copies); each step
copies the first `num_reqs` rows once and derives the host-side skip flags with numpy.
Arrays whose size varies by step (token ids for penalties, stop ids, step counters) go
through pinned staging buffers: no host sync anywhere.

With one step in flight the host does not know the token each row sampled last step (a
placeholder, -1, in `batch.token_ids`). The penalties' output ids get it on the device,
from the previous step's sampled ids, like the model's input ids do (see placeholders.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmfast.sampling_params import GREEDY_TEMPERATURE
from llmfast.worker.buffers import StagingBuffer

if TYPE_CHECKING:
    from llmfast.worker.input_batch import InputBatch


@dataclass
class SamplingMetadata:
    """Per-request sampling state for one step, one row per request.

    Device tensors are straight copies of per-request numpy arrays: the `[n]` ones are a
    slice of `max_num_seqs`-long arrays, the `[n, k]` id tensors are padded with any id
    >= vocab_size (vocab_size is the natural choice; ids are clamped, so larger is fine).
    Host fields are recomputed by the batch when its set of requests changes; the
    sampler trusts them to skip work and never reads a device value to decide anything.
    A row whose stage is off must hold the neutral value (temperature 1 or 0 for greedy,
    top_k 0, top_p 1, min_p 0, penalties 1 / 0 / 0, min_tokens 0).
    """

    temperature: torch.Tensor  # [n] f32; < GREEDY_TEMPERATURE means greedy
    top_k: torch.Tensor  # [n] int32; 0 = off
    top_p: torch.Tensor  # [n] f32; 1 = off
    min_p: torch.Tensor  # [n] f32; 0 = off
    repetition_penalty: torch.Tensor  # [n] f32; 1 = off
    presence_penalty: torch.Tensor  # [n] f32; 0 = off
    frequency_penalty: torch.Tensor  # [n] f32; 0 = off
    seeds: torch.Tensor  # [n] int64 (seed_to_int64); ignored where has_seed is False
    has_seed: torch.Tensor  # [n] bool
    step: torch.Tensor  # [n] int64: output tokens generated so far
    min_tokens: torch.Tensor  # [n] int64; stop ids are banned while step < min_tokens
    # Penalty inputs; None allowed when no_penalties.
    prompt_token_ids: torch.Tensor | None  # [n, max_prompt_len] int64, padded
    output_token_ids: torch.Tensor | None  # [n, max_output_len] int64, padded
    # EOS (unless ignore_eos) + stop_token_ids per row; None allowed when no_min_tokens.
    stop_token_ids: torch.Tensor | None  # [n, max_num_stop_ids] int64, padded
    # logit_bias / allowed_token_ids; all None when no_logit_rules.
    logit_rules: LogitRules | None
    # Host-side flags.
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_min_tokens: bool  # no row has step < min_tokens
    no_logit_rules: bool  # no row has logit_bias or allowed_token_ids
    no_seeds: bool  # no row has a seed
    max_top_k: int  # max top_k over the batch (0 if no_top_k)
    max_num_logprobs: int | None  # None: no row wants logprobs
    # Structured outputs: [n, ceil(vocab_size / 32)] int32, bit t of row r allows token t
    # (all ones in unconstrained rows); None when no row is constrained this step. Set by
    # the runner after the forward is launched (grammar_bitmask.py).
    grammar_bitmask: torch.Tensor | None = None


@dataclass
class LogitRules:
    """Per-row logit edits, padded to the widest row. Pads add 0 to the last token
    (bias) or repeat the row's first allowed id (allowed), so they change nothing."""

    bias_ids: torch.Tensor  # [n, max_num_biases] int64
    bias_values: torch.Tensor  # [n, max_num_biases] f32
    allowed_ids: torch.Tensor  # [n, max_num_allowed] int64
    has_allowed: torch.Tensor  # [n] bool; False: every token allowed


class SamplingStaging:
    """The staging buffers `build_sampling_metadata` writes, one per varying array."""

    def __init__(self, device: torch.device) -> None:
        self.step = StagingBuffer(torch.int64, device)
        self.prompt_ids = StagingBuffer(torch.int64, device)
        self.output_ids = StagingBuffer(torch.int64, device)
        self.stop_ids = StagingBuffer(torch.int64, device)
        self.pending_flat = StagingBuffer(torch.int64, device)
        self.pending_src = StagingBuffer(torch.int64, device)
        self.bias_ids = StagingBuffer(torch.int64, device)
        self.bias_values = StagingBuffer(torch.float32, device)
        self.allowed_ids = StagingBuffer(torch.int64, device)
        self.has_allowed = StagingBuffer(torch.bool, device)


def build_sampling_metadata(
    batch: InputBatch, n: int, vocab_size: int, eos_token_ids: tuple[int, ...],
    staging: SamplingStaging, prev_sampled: torch.Tensor | None = None,
) -> SamplingMetadata:
    """`prev_sampled`: the previous step's sampled ids (device), indexed by
    `batch.pending_src`, for rows whose last token is still a placeholder."""
    fixed = _per_batch_fields(batch, n)
    # Output tokens so far, placeholders included (their count is known, their value not).
    steps_np = (batch.num_tokens[:n] - batch.num_prompt_tokens[:n]).astype(np.int64)
    params = batch.sampling_params[:n]
    stop_lists = None
    no_min_tokens = bool((steps_np >= batch.sampling["min_tokens"].np[:n]).all())
    if not no_min_tokens:
        stop_lists = [
            list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            for p in params
        ]
    prompt_ids = output_ids = None
    if not fixed["no_penalties"]:
        prompt_ids, output_ids = _padded_token_ids(batch, n, vocab_size, staging, prev_sampled)
    return SamplingMetadata(
        step=staging.step.stage(steps_np),
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        stop_token_ids=None if stop_lists is None else _pad_lists(stop_lists, vocab_size,
                                                                  staging.stop_ids),
        logit_rules=(None if fixed["no_logit_rules"]
                     else _logit_rules(params, vocab_size, staging)),
        no_min_tokens=no_min_tokens,
        **fixed,
    )


def _per_batch_fields(batch: InputBatch, n: int) -> dict:
    """SamplingMetadata's fields that depend only on the rows' sampling params: the
    device copies of the per-row arrays and the flags derived from them. They change only
    when a request joins, leaves or moves (`InputBatch.version`): computed once per
    batch layout (a decode step without churn copies and reduces nothing)."""
    key = (batch.version, n)
    cached = batch.sampling_fields
    if cached is not None and cached[0] == key:
        return cached[1]
    s = {name: buf.np[:n] for name, buf in batch.sampling.items()}
    dev = {name: buf.copy_to_gpu(n) for name, buf in batch.sampling.items()}
    greedy = s["temperature"] < GREEDY_TEMPERATURE
    no_penalties = bool(
        (s["repetition_penalty"] == 1.0).all()
        and (s["presence_penalty"] == 0.0).all()
        and (s["frequency_penalty"] == 0.0).all()
    )
    logprobs = [p.logprobs for p in batch.sampling_params[:n] if p.logprobs is not None]
    fields = dict(
        temperature=dev["temperature"],
        top_k=dev["top_k"],
        top_p=dev["top_p"],
        min_p=dev["min_p"],
        repetition_penalty=dev["repetition_penalty"],
        presence_penalty=dev["presence_penalty"],
        frequency_penalty=dev["frequency_penalty"],
        seeds=dev["seed"],
        has_seed=dev["has_seed"],
        min_tokens=dev["min_tokens"],
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        no_penalties=no_penalties,
        no_top_k=bool((s["top_k"] == 0).all()),
        no_top_p=bool((s["top_p"] == 1.0).all()),
        no_min_p=bool((s["min_p"] == 0.0).all()),
        no_logit_rules=not batch.has_logit_rules[:n].any(),
        no_seeds=not bool(s["has_seed"].any()),
        max_top_k=int(s["top_k"].max(initial=0)),
        max_num_logprobs=max(logprobs) if logprobs else None,
    )
    batch.sampling_fields = (key, fields)
    return fields


def _padded_token_ids(batch: InputBatch, n: int, vocab_size: int, staging: SamplingStaging,
                      prev_sampled: torch.Tensor | None):
    """Prompt and output ids per row, padded with `vocab_size` (an id no token has).

    Worked example, vocab 100, rows with num_prompt [2, 1] and num_tokens [4, 2], row 0's
    last token a placeholder sampled last step at index 3 of `prev_sampled`:
        token_ids  = [[5 6 7 -1], [8 9 . .]]
        prompt     = [[5 6], [8 100]]
        output     = [[100 100 7 -1], [100 9 100 100]]  (width 4, absolute columns)
        pending    = flat index 0 * 4 + 3 = 3, filled on the device with prev_sampled[3]
    """
    num_prompt = batch.num_prompt_tokens[:n, None]
    num_tokens = batch.num_tokens[:n, None]
    width = int(num_tokens.max(initial=1))
    ids = batch.token_ids[:n, :width].astype(np.int64)
    cols = np.arange(width)[None, :]
    prompt = np.where(cols < num_prompt, ids, vocab_size)[:, : int(num_prompt.max(initial=1))]
    output = np.where((cols >= num_prompt) & (cols < num_tokens), ids, vocab_size)
    output_dev = staging.output_ids.stage(output)
    pending_rows = np.flatnonzero(batch.pending_src[:n] >= 0)
    if prev_sampled is not None and len(pending_rows):
        flat = pending_rows * width + batch.num_tokens[pending_rows] - 1
        src = batch.pending_src[pending_rows]
        output_dev.view(-1).index_copy_(
            0, staging.pending_flat.stage(flat),
            prev_sampled.index_select(0, staging.pending_src.stage(src)))
    return staging.prompt_ids.stage(prompt), output_dev


def _logit_rules(params: list, vocab_size: int, staging: SamplingStaging) -> LogitRules:
    """Only steps where some row has logit_bias or allowed_token_ids build these (a loop
    over the rows' params, as the stop lists do).

    Worked example, vocab 10, row 0 {3: 2.0, 5: -1.0} allowed [4, 7], row 1 nothing:
        bias_ids    = [[3 5], [9 9]]   bias_values = [[2. -1.], [0. 0.]]
        allowed_ids = [[4 7], [0 0]]   has_allowed = [True False]
    """
    biases = [p.logit_bias or {} for p in params]
    allowed = [p.allowed_token_ids or () for p in params]
    n = len(params)
    bias_ids = np.full((n, max(1, max(map(len, biases)))), vocab_size - 1, dtype=np.int64)
    bias_values = np.zeros(bias_ids.shape, dtype=np.float32)
    allowed_ids = np.zeros((n, max(1, max(map(len, allowed)))), dtype=np.int64)
    for i, (bias, ids) in enumerate(zip(biases, allowed)):
        if bias:
            bias_ids[i, : len(bias)] = list(bias)
            bias_values[i, : len(bias)] = list(bias.values())
        if ids:
            allowed_ids[i] = ids[0]
            allowed_ids[i, : len(ids)] = ids
    has_allowed = np.array([bool(ids) for ids in allowed], dtype=np.bool_)
    return LogitRules(staging.bias_ids.stage(bias_ids), staging.bias_values.stage(bias_values),
                      staging.allowed_ids.stage(allowed_ids),
                      staging.has_allowed.stage(has_allowed))


def _pad_lists(rows: list[list[int]], pad: int, staging: StagingBuffer) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    arr = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return staging.stage(arr)


__all__ = ["LogitRules", "SamplingMetadata", "SamplingStaging", "build_sampling_metadata"]


def worst_case_sampling_metadata(n: int, vocab_size: int, device: torch.device,
                                 max_num_logprobs: int = 20) -> SamplingMetadata:
    """Metadata for `n` rows with every sampler stage on, for the start-up memory profile:
    the sampler's largest temporaries are `[n, vocab_size]` tensors (the float32 logits,
    penalty counts, the sort's values and int64 indices, the seeded draw's int64 hashes),
    gigabytes at n = 512 and a 128k vocabulary, and the KV cache must leave them room.

    Rows alternate greedy / random (both paths and their merge run), random rows use
    top-k, top-p, min-p and a seed, every row has a logit bias (a quarter also allowed
    ids), penalties, a pending min_tokens ban and
    wants `max_num_logprobs` logprobs (20 is SamplingParams' most). No grammar bitmask:
    it is applied in place (no temporary), and its kernel (xgrammar's Triton one on CUDA)
    should compile at the first constrained request, not in every start-up."""
    rows = torch.arange(n, device=device)
    greedy = rows % 2 == 0

    def f32(value: float) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.float32, device=device)

    pad = torch.full((n, 1), vocab_size, dtype=torch.int64, device=device)
    return SamplingMetadata(
        temperature=torch.where(greedy, 0.0, 0.8).float(),
        top_k=torch.where(greedy, 0, max(1, vocab_size // 2)).to(torch.int32),
        top_p=torch.where(greedy, 1.0, 0.9).float(),
        min_p=torch.where(greedy, 0.0, 0.01).float(),
        repetition_penalty=f32(1.1), presence_penalty=f32(0.1), frequency_penalty=f32(0.1),
        seeds=rows.to(torch.int64), has_seed=~greedy, step=torch.zeros_like(rows),
        min_tokens=torch.ones_like(rows),
        prompt_token_ids=rows[:, None] % vocab_size, output_token_ids=pad,
        stop_token_ids=torch.zeros((n, 1), dtype=torch.int64, device=device),
        logit_rules=LogitRules(
            bias_ids=rows[:, None] % vocab_size, bias_values=torch.ones((n, 1), device=device),
            allowed_ids=(rows[:, None] + torch.arange(2, device=device)) % vocab_size,
            has_allowed=rows % 4 == 1),
        all_greedy=False, all_random=False, no_penalties=False, no_top_k=False,
        no_top_p=False, no_min_p=False, no_min_tokens=False, no_logit_rules=False,
        no_seeds=False,
        max_top_k=max(1, vocab_size // 2), max_num_logprobs=max_num_logprobs,
    )
