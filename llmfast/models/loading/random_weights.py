"""Seeded random weights for `random:<preset>` models (benchmarks, tests).

One generator per model on its device draws every parameter of the full (one-rank)
model in order, so the values depend only on (preset, seed, device kind). A
tensor-parallel rank draws the same full tensors, one at a time (peak: one full tensor
beside the rank's weights), and keeps its slices: TP=W runs the very weights TP=1 runs.
"""

from __future__ import annotations

import torch

from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.loading.load_progress import ByteProgress
from llmfast.models.loading.loader_target import target
from llmfast.models.sharding import checkpoint_names, checkpoint_slice
from llmfast.utils.progress import Progress

RANDOM_WEIGHT_STD = 0.02


def _fill(param: torch.Tensor, name: str, generator: torch.Generator,
          norm_offset: bool = False) -> None:
    if name.endswith("norm.weight"):  # unit norms; Gemma's store (scale - 1)
        param.fill_(0.0 if norm_offset else 1.0)
    else:
        param.normal_(0.0, RANDOM_WEIGHT_STD, generator=generator)


def init_random_weights(model: DecoderForCausalLM, seed: int,
                        progress: Progress | None = None) -> None:
    """Sane scales (std 0.02, unit norms), filled in place in the parameters' dtype by a
    generator on their device: no float32 or CPU copy (on a GPU milliseconds, where a
    CPU pass over 1B float32 values took ~20 s). CPU and CUDA generators differ, so the
    values are reproducible per (seed, device kind)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    named = list(model.named_parameters())  # a tied head appears once
    meter = ByteProgress("initialising random weights",
                         sum(p.numel() * p.element_size() for _, p in named), progress, device)
    if model.tp.world_size == 1:
        for name, param in named:
            _fill(param.data, name, generator, model.config.norm_offset)
            meter.add(param.numel() * param.element_size())
    else:
        _init_shards(model, dict(named), generator, meter)
    meter.finish()


def _init_shards(model: DecoderForCausalLM, params: dict[str, torch.nn.Parameter],
                 generator: torch.Generator, meter: ByteProgress) -> None:
    """Draw each parameter of the full model as TP=1 does, keep this rank's slices."""
    with torch.device("meta"):
        full = DecoderForCausalLM(model.config, max_positions=1)
    dtype, device = next(model.parameters()).dtype, generator.device
    for name, full_param in full.named_parameters():  # TP=1's order; a tied head once
        drawn = torch.empty(full_param.shape, dtype=dtype, device=device)
        _fill(drawn, name, generator, model.config.norm_offset)
        param = params.get(name)  # absent: o_proj's bias off rank 0
        if param is None:
            continue
        param.data.zero_()  # the vocabulary's padding rows
        for piece in checkpoint_names(name, model.config):
            _, full_rows = target(full, piece)  # the piece's rows in the fused tensor
            _, rows = target(model, piece)
            source = drawn if full_rows is None else drawn[full_rows]
            shard = checkpoint_slice(piece, model.config, model.tp)
            if shard is not None:
                source = source.narrow(shard.dim, shard.start, shard.size)
                if rows is None and shard.dim == 0:
                    rows = slice(0, shard.size)
            (param.data if rows is None else param.data[rows]).copy_(source)
        meter.add(param.numel() * param.element_size())
        del drawn
