"""`SpecDecoder`: the runner's side of speculative decoding, one step at a time.

1. `write_drafts` (after the SchedulerOutput is applied): each drafting row's drafts go
   into its token row just past its known tokens, without counting them as tokens, so
   that the step's input-id gather reads [last token, d1 .. dK] at positions
   num_computed .. num_computed + K like any other scheduled tokens.
2. `logits_rows` (after the inputs are prepared): the rows of the hidden states whose
   logits the rejection sampler needs, per request its K_i draft positions then its
   last scheduled position, in batch order.
3. `verify`: `rejection_sample` over those logits; its output packed as one
   [num_reqs, max_K + 2] tensor (count emitted, then the tokens) for one copy to the host.
4. `emitted` (at collect): the emitted tokens into the batch rows and per request.
5. `propose`: the proposer's drafts for every row that just sampled and may draft.

Worked example, num_scheduled [4, 1, 3] with drafts [3, 0, 2] (cu = [4, 5, 8]):
    logits rows = [0 1 2 3 | 4 | 5 6 7]   (request i: cu[i] - 1 - K_i .. cu[i] - 1)
    cu_num_draft_tokens = [0 3 3 5]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from llmfast.attention.metadata import AttentionMetadata
from llmfast.config import SpeculativeConfig
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.worker.input_batch import InputBatch
from llmfast.worker.sampling.sampler import LogprobsTensors, SamplingMetadata
from llmfast.worker.spec_decode.rejection_sampler import rejection_sample
from llmfast.worker.spec_decode.ngram_proposer import NgramProposer
from llmfast.worker.spec_decode.proposer import ProposalInputs, Proposer, StepTensors
from llmfast.worker.step_inputs import StepInputs
from llmfast.worker.step_output import PendingStep


@dataclass(frozen=True)
class TargetFacts:
    """What a draft model must match or take from the target's runner."""

    vocab_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_model_len: int
    seed: int


def make_proposer(config: SpeculativeConfig, target: TargetFacts) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    # A draft model: loaded here, its KV cache allocated once the target's is sized.
    from llmfast.models.loading.load_error import LoadError
    from llmfast.models.sources.model_source import resolve_model
    from llmfast.worker.spec_decode.draft_proposer import DraftModelProposer

    try:
        source = resolve_model(config.draft_model)
    except LoadError as e:
        raise LoadError(f"--speculative-model {config.draft_model}: {e}") from e
    return DraftModelProposer(config.num_speculative_tokens, source,
                              target_vocab_size=target.vocab_size, dtype=target.dtype,
                              device=target.device, max_model_len=target.max_model_len,
                              kv_dtype=target.kv_dtype, seed=target.seed)


def spec_logits_rows(num_sched: np.ndarray, num_drafts: np.ndarray, out: np.ndarray) -> int:
    """Fill `out` with the logits rows (the module doc's example); returns their count.
    A row with nothing scheduled still gets one (index max(cu - 1, 0)), whose sample is
    discarded, as in the plain path."""
    cu = np.cumsum(num_sched)
    counts = num_drafts + 1
    total = int(counts.sum())
    starts = np.maximum(cu - 1, 0) - num_drafts  # [n] each request's first row
    cu_counts = np.cumsum(counts)
    offsets = np.arange(total) - np.repeat(cu_counts - counts, counts)
    out[:total] = np.repeat(starts, counts) + offsets
    return total


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_num_reqs: int, max_num_tokens: int,
                 device: torch.device, proposer: Proposer) -> None:
        """`proposer`: make_proposer's for `config` (a test or benchmark may put its own
        in its place)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        # A proposer with a KV cache of its own (a draft model) reads the target step's
        # tensors (StepTensors); the n-gram proposer needs none.
        self.needs_step_tensors = self.proposer.num_lookahead_slots > 0
        self.logits_indices = CpuGpuBuffer(max_num_tokens + max_num_reqs, dtype=torch.int64,
                                           device=device)
        self.draft_token_ids = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.cu_num_draft_tokens = CpuGpuBuffer(max_num_reqs + 1, dtype=torch.int32,
                                                device=device)
        self.num_drafts = np.zeros(max_num_reqs, dtype=np.int64)  # this step's, per row
        self.max_num_drafts = 0  # this step's most drafts in a row (sizes the output)
        # A draft model sampling its drafts: the distributions they were drawn from,
        # [rows then, K, vocab] on the device, and each request's row then; the next
        # step's verify gathers its drafts' rows (`write_drafts`).
        self._proposed_probs: torch.Tensor | None = None
        self._proposed_rows: dict[str, int] = {}
        self.draft_probs: torch.Tensor | None = None  # this step's [num_drafts, vocab]
        self.draft_probs_index = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        # Per row, whether it sampled this step (a draft model's StepTensors).
        self.sampled_rows = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)
        # Per logits row, its request's row: a per-request grammar bitmask expanded.
        self.row_req = CpuGpuBuffer(max_num_tokens + max_num_reqs, dtype=torch.int64,
                                    device=device)

    # ------------------------------------------------------------------ before the forward

    def write_drafts(self, out: SchedulerOutput, batch: InputBatch) -> int:
        """Place this step's drafts in their rows (module doc, 1.); the number of drafts."""
        n = batch.num_reqs
        num_drafts = self.num_drafts
        num_drafts[:n] = 0
        self.max_num_drafts = 0
        self.draft_probs = None
        spec = out.scheduled_spec_decode_tokens
        if not spec:
            return 0
        index = batch.req_id_to_index
        token_ids, num_tokens = batch.token_ids, batch.num_tokens
        for rid, drafts in spec.items():  # per drafting request, not per token
            row = index[rid]
            start = num_tokens[row]
            token_ids[row, start:start + len(drafts)] = drafts
            num_drafts[row] = len(drafts)
        rows = np.flatnonzero(num_drafts[:n])
        counts = num_drafts[rows]
        self.max_num_drafts = int(counts.max())
        total = int(counts.sum())
        cu_counts = np.cumsum(counts)
        offsets = np.arange(total) - np.repeat(cu_counts - counts, counts)
        self.draft_token_ids.np[:total] = token_ids[
            np.repeat(rows, counts), np.repeat(num_tokens[rows].astype(np.int64), counts) + offsets]
        self.cu_num_draft_tokens.np[0] = 0
        np.cumsum(num_drafts[:n], out=self.cu_num_draft_tokens.np[1:n + 1])
        if self._proposed_probs is not None:
            self.draft_probs = self._gather_probs(batch, rows, counts, offsets, total)
        return total

    def _gather_probs(self, batch: InputBatch, rows: np.ndarray, counts: np.ndarray,
                      offsets: np.ndarray, total: int) -> torch.Tensor | None:
        """This step's drafts' distributions, in draft order: draft j of the request in
        row r came from row `_proposed_rows[req]` of the proposal, position j. None if a
        drafting request has none (then every draft counts as a point mass)."""
        probs, then = self._proposed_probs, self._proposed_rows
        rows_then = [then.get(batch.req_ids[r], -1) for r in rows.tolist()]
        if min(rows_then) < 0:
            return None
        k = probs.shape[1]
        index = self.draft_probs_index
        index.np[:total] = np.repeat(np.asarray(rows_then, dtype=np.int64) * k, counts) + offsets
        return probs.reshape(-1, probs.shape[-1]).index_select(0, index.copy_to_gpu(total))

    def logits_rows(self, num_sched: np.ndarray, num_draft_total: int) -> torch.Tensor:
        """The device indices of the hidden rows to compute logits for (module doc, 2.)."""
        n = len(num_sched)
        total = spec_logits_rows(num_sched, self.num_drafts[:n], self.logits_indices.np)
        self.draft_token_ids.copy_to_gpu(num_draft_total)
        self.cu_num_draft_tokens.copy_to_gpu(n + 1)
        return self.logits_indices.copy_to_gpu(total)

    # ------------------------------------------------------------------ the verify step

    def verify(self, logits: torch.Tensor, md: SamplingMetadata, num_reqs: int,
               num_draft_total: int) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """Rejection-sample the step's logits; returns (packed [num_reqs, max_K + 2] int64:
        per request its number of emitted tokens, then the tokens; logprobs laid out
        [num_reqs, max_K + 1, ...] like the tokens)."""
        if md.grammar_bitmask is not None:
            # One row per logits row (rejection_sampler.py): a constrained request has no
            # drafts (eligibility.py), so its one row is its own; a drafting request's
            # rows take its (all-allowing) mask row.
            counts = self.num_drafts[:num_reqs] + 1
            total = int(counts.sum())
            self.row_req.np[:total] = np.repeat(np.arange(num_reqs), counts)
            md = dataclasses.replace(md, grammar_bitmask=md.grammar_bitmask.index_select(
                0, self.row_req.copy_to_gpu(total)))
        result = rejection_sample(
            logits, self.draft_token_ids.gpu[:num_draft_total],
            self.cu_num_draft_tokens.gpu[:num_reqs + 1], self.draft_probs, md,
            max_num_draft_tokens=self.max_num_drafts)
        packed = torch.cat([result.num_emitted.to(torch.int64)[:, None],
                            result.output_token_ids.to(torch.int64)], dim=1)
        return packed, result.logprobs

    # ------------------------------------------------------------------ after the step

    @staticmethod
    def emitted(packed: np.ndarray, batch: InputBatch, sampling_rows: np.ndarray,
                placeholder_cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write each sampling row's emitted tokens into its batch row (the first where
        its placeholder sits) and count them; returns (num_emitted [n], tokens [n, w])."""
        num_emitted = packed[:, 0]
        tokens = packed[:, 1:]
        if len(sampling_rows):
            m = num_emitted[sampling_rows]
            cu = np.cumsum(m)
            offsets = np.arange(int(cu[-1])) - np.repeat(cu - m, m)
            rows = np.repeat(sampling_rows, m)
            batch.token_ids[rows, np.repeat(placeholder_cols, m) + offsets] = tokens[rows, offsets]
            batch.num_tokens[sampling_rows] = placeholder_cols + m
        return num_emitted, tokens

    def step_tensors(self, inputs: StepInputs, batch: InputBatch, md: AttentionMetadata,
                     num_tokens: int, tokens: torch.Tensor, sampling_rows: np.ndarray
                     ) -> StepTensors:
        """The step's tensors for a draft model (proposer.py's StepTensors): views of the
        persistent buffers, valid until the next step's inputs are prepared. `tokens`:
        the sampled ids [n] or the verify step's packed [n, K + 2]."""
        n = batch.num_reqs
        # 1 where the row sampled (a verify row: times its emitted count, on the device).
        sampled = self.sampled_rows
        sampled.np[:n] = 0
        sampled.np[sampling_rows] = 1
        num_emitted = sampled.copy_to_gpu(n)
        if tokens.dim() == 1:
            out_ids = tokens[:, None]
        else:
            out_ids = tokens[:, 1:]
            num_emitted = num_emitted * tokens[:, 0].to(torch.int32)
        return StepTensors(
            input_ids=inputs.input_ids.gpu[:num_tokens], positions=inputs.positions.gpu[:num_tokens],
            slot_mapping=md.slot_mapping[:num_tokens], query_start_loc=inputs.query_start_loc.gpu[:n + 1],
            seq_lens=inputs.seq_lens.gpu[:n], block_table=batch.block_table.table.gpu[:n],
            output_token_ids=out_ids, num_emitted=num_emitted)

    def collect_verify(self, step: PendingStep, packed: np.ndarray,
                       batch: InputBatch) -> ModelRunnerOutput:
        """The runner's `collect` for a verify step (module doc, 4. and 5.): a variable
        number of tokens per request, their logprobs, the next drafts."""
        if step.batch_version != batch.version:
            raise RuntimeError("a verify step collected after the batch changed")
        batch.pending_src[:] = -1  # (the synchronous loop: see ModelRunner.collect)
        num_emitted, tokens = self.emitted(packed, batch, step.sampling_rows,
                                           step.placeholder_cols)
        counts = num_emitted.tolist()
        token_rows = tokens.tolist()
        out = [token_rows[r][:counts[r]] if s else [] for r, s in zip(step.rows, step.samples)]
        logprobs = None
        if step.logprobs_host is not None:
            logprobs = collect_verify_logprobs(step.logprobs_host, step.rows, step.samples,
                                               step.num_logprobs, counts)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=out,
                                 logprobs=logprobs,
                                 prompt_logprobs=step.collect_prompt_logprobs(),
                                 spec_token_ids=self.propose_for(step, batch))

    def propose_for(self, step: PendingStep, batch: InputBatch) -> list[list[int]]:
        """The drafts for the next step, per scheduled request of `step` (collected)."""
        drafts = self.propose(batch, step.sampling_rows, step.spec_step, step.spec_sampling)
        return [drafts[r] for r in step.rows]

    def propose(self, batch: InputBatch, sampling_rows: np.ndarray,
                step: StepTensors | None = None,
                sampling: SamplingMetadata | None = None) -> list[list[int]]:
        """Drafts for the next step, per batch row 0..n-1 ([] where none). `step`: the
        target step's tensors, for a draft model; `sampling`: the step's metadata, for a
        draft model to sample its drafts as each row samples (None: greedy drafts)."""
        self._proposed_probs = None
        n = batch.num_reqs
        max_num_drafts = np.zeros(n, dtype=np.int32)
        allowed = sampling_rows[batch.spec_allowed[sampling_rows]]
        max_num_drafts[allowed] = self.k
        # Never past max_model_len: the drafts and one more token must fit in the row.
        np.minimum(max_num_drafts, batch.max_model_len - 1 - batch.num_tokens[:n],
                   out=max_num_drafts)
        np.maximum(max_num_drafts, 0, out=max_num_drafts)
        if not max_num_drafts.any() and not self.needs_step_tensors:
            # (A draft model still catches its KV cache up with the step.)
            return [[] for _ in range(n)]
        inputs = ProposalInputs(
            req_ids=batch.req_ids[:n], token_ids=batch.token_ids,
            num_tokens=batch.num_tokens[:n], max_num_drafts=max_num_drafts, step=step)
        drafts = (self.proposer.propose(inputs, sampling) if sampling is not None
                  else self.proposer.propose(inputs))
        if drafts.probs is not None:
            self._proposed_probs = drafts.probs
            self._proposed_rows = {rid: r for r, rid in enumerate(batch.req_ids[:n])}
        return drafts.as_lists()


def collect_verify_logprobs(lp: LogprobsTensors, rows: list[int], samples: list[bool],
                            num_logprobs: list[int | None], counts: list[int]
                            ) -> list[list[tuple[float, dict[int, float]]]]:
    """Per scheduled row: [(emitted token's logprob, {top id: logprob})] for each token it
    emitted, where it asked for logprobs, else []. `lp` on the host, laid out
    [num_reqs, max_K + 1, ...] (rejection_sampler.py); `counts`: emitted per row."""
    sampled_lp = lp.sampled_logprobs.numpy()
    top_ids, top_lps = lp.topk_ids.numpy(), lp.topk_logprobs.numpy()
    result: list[list[tuple[float, dict[int, float]]]] = []
    for r, sampled_here, want in zip(rows, samples, num_logprobs):
        if not sampled_here or want is None:
            result.append([])
            continue
        result.append([
            (float(sampled_lp[r, j]),
             {int(i): float(v) for i, v in zip(top_ids[r, j, :want], top_lps[r, j, :want])})
            for j in range(counts[r])])
    return result
