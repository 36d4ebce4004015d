"""The draft-model proposer: a smaller model of the target's tokenizer drafts K tokens.

Its KV cache is laid out like the target's (same num_blocks and block_size) and is
addressed by the target's block table: a request's block ids and slots serve both
caches, so the scheduler allocates once (plus `num_lookahead_slots` = K slots past the
scheduled tokens, where the drafting steps write). The KV-cache sizing must count
`kv_block_bytes` of the draft in every block.

After each target step the draft catches up and drafts, for every row that ran:
1. one varlen forward over the tokens the target's step made final: from the step's
   first query position up to the row's last known token (the accepted prefix of the
   query, then the last emitted token; a prefill chunk's tokens, plus the sampled token
   when the chunk ended the prompt). Rows whose KV it rewrites get the same values (same
   tokens, same positions); rows that may not draft only catch up.
2. the first draft from the logits of each drafting row's last token, then K - 1
   single-token forwards, each feeding the previous draft at the next position.

Worked example, block_size 4, a row whose step queried [t9 d1 d2 d3] at positions 9..12
and emitted [d1 r] (d1 accepted, d2 rejected; 11 known tokens now): the catch-up feeds
[t9 d1 r] at positions 9, 10, 11 (query 3 tokens, seq_len 12), its logits at r give
draft e1; then e1 at position 12, e2 at 13, ... (slots from the row's block table).

Drafts are greedy (point masses, `Drafts.probs` None) unless the step's sampling
metadata is given: then a random row draws each draft from the draft model's
distribution after the row's temperature / top-k / top-p / min-p (the plain sampler's
`random_probs`), and those distributions are returned for the rejection sampler. Seeded
rows draw with their seed salted, so that the draft's noise is independent of the
verifier's (rejection_sampler.py), at the draft's absolute token position.
"""

from __future__ import annotations

import numpy as np
import torch

from llmfast.attention.metadata import AttentionMetadata
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.models.loading.load_error import LoadError
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import ModelSource
from llmfast.sampling_params import GREEDY_TEMPERATURE, seed_to_int64
from llmfast.worker.buffers import StagingBuffer
from llmfast.worker.sampling.sampler import exponential_race, random_probs, seeded_exponential
from llmfast.worker.sampling.sampling_metadata import SamplingMetadata
from llmfast.worker.spec_decode.proposer import Drafts, ProposalInputs, Proposer, StepTensors
from llmfast.worker.spec_decode.rejection_sampler import expand_metadata
from llmfast.worker.startup.kv_cache_sizing import kv_block_bytes

# XORed into a seeded row's seed for its drafts (any constant != 0 decorrelates them).
_DRAFT_SEED_SALT = seed_to_int64(0x6A09E667F3BCC909)


class DraftModelProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, source: ModelSource, *,
                 target_vocab_size: int, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int, kv_dtype: torch.dtype | None = None,
                 seed: int = 0) -> None:
        super().__init__(num_speculative_tokens)
        if source.config.vocab_size != target_vocab_size:
            raise LoadError(
                f"the draft model {source.name} has a vocabulary of "
                f"{source.config.vocab_size} tokens, the target's has {target_vocab_size}; "
                "a draft model must share the target's tokenizer")
        self.device = torch.device(device)
        self.model = build_model(source, dtype, self.device, max_positions=max_model_len,
                                 seed=seed)
        self.kv_dtype = kv_dtype or dtype
        self.max_model_len = max_model_len
        # The K drafting forwards write KV at positions up to K - 1 past the last known
        # token; K keeps the scheduler's arithmetic simple (one lookahead per draft).
        self.num_lookahead_slots = num_speculative_tokens
        self.block_size = 0
        self.kv_cache: torch.Tensor | None = None
        self._staging = {name: StagingBuffer(dtype, self.device) for name, dtype in (
            ("ids", torch.int64), ("positions", torch.int64), ("block_rows", torch.int64),
            ("rows", torch.int64), ("query_start_loc", torch.int32),
            ("seq_lens", torch.int32), ("last", torch.int64), ("draft_rows", torch.int64),
            ("draft_positions", torch.int64), ("draft_valid", torch.bool))}

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one block of the draft's cache takes (all its layers, K and V): what the
        target's KV-cache sizing adds to its own per block."""
        return kv_block_bytes(self.model.rank_config, block_size, self.kv_dtype)

    def initialize(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model.rank_config
        # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(cfg.num_hidden_layers, 2, num_blocks, block_size,
                                    cfg.num_key_value_heads, cfg.head_dim,
                                    dtype=self.kv_dtype, device=self.device)
        self.model.bind_kv_caches([(layer[0], layer[1]) for layer in self.kv_cache])
        self.workspaces = AttentionWorkspaces([self.kv_cache])
        self.block_size = block_size

    @torch.inference_mode()
    def propose(self, inputs: ProposalInputs,
                sampling: SamplingMetadata | None = None) -> Drafts:
        """`sampling`: the step's per-row metadata (rows 0..n-1), for drafts drawn with
        each row's temperature and filters; None: greedy drafts."""
        n, k = len(inputs.req_ids), self.num_speculative_tokens
        token_ids = np.full((n, k), -1, dtype=np.int64)
        num_drafts = np.zeros(n, dtype=np.int32)
        step = inputs.step
        if step is None or self.kv_cache is None:
            return Drafts(token_ids, num_drafts)
        first_pos, num_query, num_emitted = _step_host_view(step, n)
        # Each row catches up over [first_pos, end): the known tokens the step computed,
        # plus the sampled one (a partial prefill chunk: only its tokens).
        end = np.where(num_emitted > 0, inputs.num_tokens[:n],
                       first_pos + num_query).astype(np.int64)
        length = np.where(num_query > 0, end - first_pos, 0)
        rows = np.flatnonzero(length > 0)
        if not len(rows):
            return Drafts(token_ids, num_drafts)
        hidden, last = self._catch_up(inputs.token_ids, step.block_table, rows,
                                      first_pos[rows], length[rows])
        # Rows that draft: may (max_num_drafts) and sampled a token this step.
        drafting = (inputs.max_num_drafts[rows] > 0) & (num_emitted[rows] > 0)
        if not drafting.any():
            return Drafts(token_ids, num_drafts)
        draft_rows = rows[drafting]
        # One staging buffer per array: a buffer restaged while its copy is in flight
        # would hand the device the new values.
        draft_rows_dev = self._stage("draft_rows", draft_rows)
        tokens, probs = self._draft(hidden[self._stage("last", last[drafting])],
                                    step.block_table, draft_rows, draft_rows_dev,
                                    inputs.num_tokens[draft_rows].astype(np.int64),
                                    inputs.max_num_drafts[draft_rows], sampling)
        counts = np.minimum(inputs.max_num_drafts[draft_rows], k)
        drafted = tokens.cpu().numpy()  # the one host sync: the scheduler takes lists
        token_ids[draft_rows] = np.where(np.arange(k)[None, :] < counts[:, None], drafted, -1)
        num_drafts[draft_rows] = counts
        if probs is not None:
            full = torch.zeros(n, k, probs.shape[-1], dtype=probs.dtype, device=probs.device)
            full[draft_rows_dev] = probs
            probs = full
        return Drafts(token_ids, num_drafts, probs)

    # ------------------------------------------------------------------ the forwards

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        return self._staging[name].stage(np.ascontiguousarray(array))

    def _slots(self, block_table: torch.Tensor, block_rows: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """slot = block_table[row, pos // block_size] * block_size + pos % block_size."""
        bs = self.block_size
        blocks = block_table[block_rows, positions // bs].to(torch.int64)
        return blocks * bs + positions % bs

    def _catch_up(self, token_ids: np.ndarray, block_table: torch.Tensor, rows: np.ndarray,
                  start: np.ndarray, length: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The varlen forward (module doc, 1.); returns its hidden states and, per row,
        the index of its last token in them.

        Worked example, rows [0, 2] starting at positions [9, 4] with lengths [3, 2]:
        ids = token_ids[0, 9:12] + token_ids[2, 4:6], positions [9 10 11 4 5],
        query_start_loc [0 3 5], seq_lens [12 6], last [2 4]."""
        cu = np.cumsum(length)
        offsets = np.arange(int(cu[-1])) - np.repeat(cu - length, length)
        tok_rows = np.repeat(rows, length)
        positions = np.repeat(start, length) + offsets
        query_start_loc = np.concatenate([[0], cu]).astype(np.int32)
        pos_dev = self._stage("positions", positions)
        block_rows = self._stage("block_rows", tok_rows)
        md = AttentionMetadata(
            slot_mapping=self._slots(block_table, block_rows, pos_dev),
            block_table=block_table[self._stage("rows", rows)],
            query_start_loc=self._stage("query_start_loc", query_start_loc),
            seq_lens=self._stage("seq_lens", (start + length).astype(np.int32)))
        hidden = self.model(self._stage("ids", token_ids[tok_rows, positions]), pos_dev, md)
        return hidden, cu - 1

    def _draft(self, last_hidden: torch.Tensor, block_table: torch.Tensor,
               rows: np.ndarray, rows_dev: torch.Tensor, num_tokens: np.ndarray,
               max_num_drafts: np.ndarray,
               sampling: SamplingMetadata | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K drafts for `rows` (module doc, 2.): [D, K] token ids and, when sampling,
        [D, K, vocab] their distributions."""
        k, d = self.num_speculative_tokens, len(rows)
        # [D, K] positions of draft j (the token drafted at num_tokens + j) and of the
        # forward that feeds draft j - 1 (at num_tokens - 1 + j). Forwards past a row's
        # allowed drafts write nothing (slot -1) at a clamped position.
        draft_pos = num_tokens[:, None] + np.arange(k)[None, :]
        valid = np.arange(k)[None, :] < max_num_drafts[:, None]
        feed_pos = np.minimum(draft_pos - 1, self.max_model_len - 1)
        feed_pos_dev = self._stage("draft_positions", feed_pos)  # [D, K]
        valid_dev = self._stage("draft_valid", valid)
        block_rows = block_table[rows_dev]  # [D, max_blocks]
        row_md = seeds = None
        if sampling is not None and not sampling.all_greedy:
            zeros = torch.zeros(d, dtype=torch.int64, device=rows_dev.device)
            row_md = expand_metadata(sampling, rows_dev, zeros, None)
            seeds = row_md.seeds ^ _DRAFT_SEED_SALT
        draft_pos_dev = feed_pos_dev + 1  # only seeds read it: clamping changes no draft

        tokens, probs = [], []
        logits = self.model.compute_logits(last_hidden)  # [D, vocab]
        query_start_loc = torch.arange(d + 1, dtype=torch.int32, device=rows_dev.device)
        for j in range(k):  # K forwards of D tokens, not a loop over tokens
            if j:
                pos = feed_pos_dev[:, j]
                slots = torch.where(valid_dev[:, j], self._slots(
                    block_table, rows_dev, pos), -1)
                md = AttentionMetadata(slot_mapping=slots, block_table=block_rows,
                                       query_start_loc=query_start_loc,
                                       seq_lens=(pos + 1).to(torch.int32))
                logits = self.model.compute_logits(self.model(tokens[-1], pos, md))
            token, q = self._sample(logits, row_md, seeds, draft_pos_dev[:, j])
            tokens.append(token)
            probs.append(q)
        return torch.stack(tokens, dim=1), (
            None if row_md is None else torch.stack(probs, dim=1))

    @staticmethod
    def _sample(logits: torch.Tensor, row_md: SamplingMetadata | None,
                seeds: torch.Tensor | None,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        greedy = logits.argmax(dim=-1)
        if row_md is None:
            return greedy, None
        q = random_probs(logits.float(), row_md)  # [D, vocab]
        noise = torch.empty_like(q).exponential_()
        if not row_md.no_seeds:
            noise = torch.where(row_md.has_seed[:, None],
                                seeded_exponential(seeds, positions, q.shape[-1]), noise)
        token = exponential_race(q.clone(), noise)
        is_greedy = row_md.temperature < GREEDY_TEMPERATURE
        return torch.where(is_greedy, greedy, token), q


def _step_host_view(step: StepTensors, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of the step: its first query position, query length and emitted count, on
    the host. Small copies; the step is finished when its proposals are asked for."""
    query_start_loc = step.query_start_loc[:n + 1].to(torch.int64)
    num_query = query_start_loc[1:] - query_start_loc[:-1]
    # A row with no query reads some position; its length 0 leaves it unused.
    first = step.positions[query_start_loc[:-1].clamp(max=step.positions.shape[0] - 1)]
    packed = torch.stack([first.to(torch.int64), num_query,
                          step.num_emitted[:n].to(torch.int64)]).cpu().numpy()
    return packed[0], packed[1], packed[2]
