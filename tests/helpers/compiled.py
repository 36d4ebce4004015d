"""A compiled model with its CUDA graphs (emulated on the CPU) built as the runner builds
them: one `ModelCudaGraphs` whose piece wrapper the `CompiledModel` applies, one stats
object. The graphs are `cm.graphs`."""

from __future__ import annotations

import torch
from torch import nn

from llmfast.compile import CompiledModel, CompileStats
from llmfast.config import CompileConfig
from llmfast.cuda_graphs.model_graphs import ModelCudaGraphs


def compiled_model(model: nn.Module, config: CompileConfig, device: torch.device | str,
                   max_num_tokens: int, *, max_num_reqs: int | None = None,
                   graph_impl: str = "auto", **kwargs) -> CompiledModel:
    """`kwargs`: CompiledModel's (piece_compiler, precompile)."""
    stats = CompileStats()
    graphs = ModelCudaGraphs(config, device, max_num_tokens, max_num_reqs=max_num_reqs,
                             graph_impl=graph_impl, stats=stats)
    return CompiledModel(model, config, device, graphs=graphs, stats=stats, **kwargs)
