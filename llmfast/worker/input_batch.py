"""The persistent input batch: per-request state as struct-of-arrays rows.

Allocated once from `max_num_reqs` and `max_model_len`. A request keeps its row while
it runs; `condense()` moves tail rows into holes so the used rows are `0..num_reqs-1`
and every per-step computation is a slice of these arrays.

A row's last token may be a placeholder (`PLACEHOLDER_TOKEN_ID`): sampled by the step
just launched, its value still on the device. `pending_src[row]` is the row's index in
that step's sampled ids, which the next step's inputs gather from on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmfast.sampling_params import SamplingParams, seed_to_int64
from llmfast.worker.block_table import BlockTable
from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.worker.spec_decode.eligibility import drafts_allowed

# Written where a sampled token's value is not known on the host yet; never a valid id,
# so a placeholder that reached the model unfilled fails loudly instead of passing.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # at (re)admission; later tokens live in the batch row
    sampling_params: SamplingParams
    block_ids: list[int]  # all of the request's blocks (new ones appended each step)
    # At (re)admission; later counts live in the batch row (`InputBatch.num_computed_tokens`).
    num_computed_tokens: int


# Per-request sampling arrays: (name, numpy dtype, torch dtype, default for an empty row).
_SAMPLING_ARRAYS = (
    ("temperature", np.float32, torch.float32, 1.0),
    ("top_k", np.int32, torch.int32, 0),
    ("top_p", np.float32, torch.float32, 1.0),
    ("min_p", np.float32, torch.float32, 0.0),
    ("repetition_penalty", np.float32, torch.float32, 1.0),
    ("presence_penalty", np.float32, torch.float32, 0.0),
    ("frequency_penalty", np.float32, torch.float32, 0.0),
    ("seed", np.int64, torch.int64, 0),
    ("has_seed", np.bool_, torch.bool, False),
    ("min_tokens", np.int64, torch.int64, 0),
)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_ids: list[str | None] = [None] * max_num_reqs  # row -> req id
        self.req_id_to_index: dict[str, int] = {}
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        self._free_rows: list[int] = []  # holes left by removals, reused first
        self._num_rows_used = 0  # rows 0.._num_rows_used-1 are used or holes
        # Bumped whenever a request joins, leaves or changes rows: equal values mean the
        # same request in every row (a collected step skips its per-request lookups).
        self.version = 0
        # build_sampling_metadata's per-layout fields, with the (version, num_reqs) they
        # were computed for.
        self.sampling_fields: tuple | None = None

        # [max_num_reqs, max_model_len]: prompt then output token ids of each row.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Index in the last launched step's sampled ids of the row's placeholder, or -1.
        self.pending_src = np.full(max_num_reqs, -1, dtype=np.int64)
        # Whether the row's params carry logit_bias / allowed_token_ids: the sampling
        # metadata reads its params only when some row does.
        self.has_logit_rules = np.zeros(max_num_reqs, dtype=np.bool_)
        # Top-n prompt logprobs the row wants, or -1 (most rows): a step finds the rows
        # that score prompt tokens with one vectorised test (prompt_logprobs.py).
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        # Whether the row's request may get draft tokens (speculative decoding,
        # spec_decode/eligibility.py): the proposer reads it for every row each step.
        self.spec_allowed = np.zeros(max_num_reqs, dtype=np.bool_)

        self.sampling = {
            name: CpuGpuBuffer(max_num_reqs, dtype=tdtype, device=device)
            for name, _, tdtype, _ in _SAMPLING_ARRAYS
        }
        max_blocks = -(-max_model_len // block_size)
        self.block_table = BlockTable(
            max_num_reqs, max_blocks, max_num_batched_tokens, block_size, device
        )

    # ------------------------------------------------------------------ rows

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id} is already in the batch")
        if self._free_rows:
            self._free_rows.sort(reverse=True)
            row = self._free_rows.pop()  # the lowest hole
        else:
            if self._num_rows_used >= self.max_num_reqs:
                raise RuntimeError("input batch is full")
            row = self._num_rows_used
            self._num_rows_used += 1
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.version += 1

        prompt, output = state.prompt_token_ids, state.output_token_ids
        n_prompt, n_total = len(prompt), len(prompt) + len(output)
        self.token_ids[row, :n_prompt] = prompt
        self.token_ids[row, n_prompt:n_total] = output
        self.num_prompt_tokens[row] = n_prompt
        self.num_tokens[row] = n_total
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.pending_src[row] = -1

        params = state.sampling_params
        self.sampling_params[row] = params
        self.has_logit_rules[row] = params.has_logit_rules
        # A request resumed with tokens generated has had its whole prompt scored.
        wants_prompt = params.prompt_logprobs is not None and not output
        self.num_prompt_logprobs[row] = params.prompt_logprobs if wants_prompt else -1
        self.spec_allowed[row] = drafts_allowed(params)
        values = {
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "seed": seed_to_int64(params.seed) if params.seed is not None else 0,
            "has_seed": params.seed is not None,
            "min_tokens": params.min_tokens,
        }
        for name, value in values.items():
            self.sampling[name].np[row] = value
        self.block_table.add_row(row, state.block_ids)
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.req_ids[row] = None
        self.sampling_params[row] = None
        self.pending_src[row] = -1
        self.has_logit_rules[row] = False
        self.num_prompt_logprobs[row] = -1
        self.spec_allowed[row] = False
        self.block_table.clear_row(row)
        self._free_rows.append(row)
        return row

    def condense(self) -> None:
        """Move the last used rows into the holes so rows 0..num_reqs-1 are all used.

        Example: rows [a, _, b, _, c] (holes at 1 and 3) -> c moves to 1 -> [a, c, b].
        """
        holes = sorted(self._free_rows)
        self._free_rows.clear()
        last = self._num_rows_used - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        self._num_rows_used = self.num_reqs

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        self.version += 1
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                    self.pending_src, self.has_logit_rules, self.num_prompt_logprobs,
                    self.spec_allowed):
            arr[dst] = arr[src]
        self.has_logit_rules[src] = False
        self.pending_src[src] = -1
        self.num_prompt_logprobs[src] = -1
        self.spec_allowed[src] = False
        for buf in self.sampling.values():
            buf.np[dst] = buf.np[src]
        self.block_table.move_row(src, dst)
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self.req_id_to_index[req_id] = dst

    # ------------------------------------------------------------------ tokens

    def output_token_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]
