"""The step's peak memory on CUDA, measured before the KV cache is sized.

The largest step the scheduler can produce (max_num_batched_tokens tokens over up to
max_num_seqs requests) runs once on a throwaway KV cache, followed by the sampler on
max_num_seqs rows with every stage on (its [rows, vocab] temporaries reach gigabytes);
what they allocated beyond that cache is what the KV cache must leave free.
"""

from __future__ import annotations

import numpy as np
import torch

from llmfast.attention.metadata import AttentionMetadata
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.worker.sampling.sampler import Sampler
from llmfast.worker.sampling.sampling_metadata import worst_case_sampling_metadata


def profile_batch(max_num_tokens: int, max_num_reqs: int, block_size: int,
                  device: torch.device, max_model_len: int | None = None,
                  num_kv_groups: int = 1
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """The largest step: (input ids, positions, metadata, blocks its table names + 1).

    No step holds more than max_model_len tokens of a request: with few sequences and a
    large token budget the largest step is smaller than the budget (and positions past
    max_model_len would read past the rotary table). E.g. 8192 tokens over 256 requests
    of 32 tokens, block size 16: each request's table row names 2 blocks, 1..512."""
    num_tokens = min(max_num_tokens, max_num_reqs * (max_model_len or max_num_tokens))
    num_reqs = min(max_num_reqs, num_tokens)
    tokens_per_req = -(-num_tokens // num_reqs)  # ceil
    blocks_per_req = -(-tokens_per_req // block_size)
    num_blocks = num_reqs * blocks_per_req + 1
    per_req = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    per_req[: num_tokens % num_reqs] += 1
    cu = np.concatenate([[0], np.cumsum(per_req)])
    req_idx = np.repeat(np.arange(num_reqs), per_req)
    positions = np.arange(num_tokens) - cu[req_idx]
    table = torch.arange(1, num_blocks, dtype=torch.int32, device=device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    table = table.view(num_reqs, blocks_per_req)
    md = AttentionMetadata(
        slot_mapping=slots,
        block_table=table,
        query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(per_req, dtype=torch.int32, device=device),
        # Several KV-cache groups: every group reads the same (scratch) blocks.
        group_slot_mappings=(slots,) * num_kv_groups if num_kv_groups > 1 else None,
        group_block_tables=(table,) * num_kv_groups if num_kv_groups > 1 else None,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return ids, torch.tensor(positions, device=device), md, num_blocks


def profile_peak_memory(model: DecoderForCausalLM, sampler: Sampler, max_num_tokens: int,
                        max_num_reqs: int, block_size: int, dtype: torch.dtype,
                        device: torch.device, max_model_len: int | None = None) -> int:
    """Run the largest forward and sampling once on a throwaway cache; return peak bytes
    in use."""
    cfg = model.rank_config  # this rank's KV heads
    ids, positions, md, num_blocks = profile_batch(max_num_tokens, max_num_reqs, block_size,
                                                   device, max_model_len,
                                                   model.kv_groups.num_groups)
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    scratch = [(torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))
               for _ in range(cfg.num_hidden_layers)]
    model.bind_kv_caches(scratch)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        hidden = model(ids, positions, md)
        logits = model.compute_logits(hidden[: max_num_reqs])  # [rows, vocab_size]
        del hidden
        rows = logits.shape[0]
        sampler(logits, worst_case_sampling_metadata(rows, logits.shape[-1], device))
        del logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - sum(
        2 * k.numel() * k.element_size() for k, _ in scratch)
    # The model still holds the scratch caches: bind one-block ones instead (the graph
    # memory estimate's dummy forwards read block 0 alone), so that the scratch memory
    # is free again before the real cache is sized and allocated beside it.
    bind_one_block_caches(model, block_size, dtype, device)
    del scratch
    torch.cuda.empty_cache()
    return peak


def bind_one_block_caches(model: DecoderForCausalLM, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> None:
    """Give every layer a one-block KV cache (what dummy forwards read: block 0)."""
    cfg = model.rank_config
    shape = (1, block_size, cfg.num_key_value_heads, cfg.head_dim)
    model.bind_kv_caches([(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(cfg.num_hidden_layers)])
