"""What capturing the CUDA graphs did (the compiled model's `CompileStats` extends it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GraphStats:
    captured_sizes: tuple[int, ...] = ()  # token counts with CUDA graphs, ascending
    num_cuda_graphs: int = 0  # piecewise graphs: pieces x sizes
    full_graph_sizes: tuple[int, ...] = ()  # uniform-decode sizes with a full graph
    capture_time_s: float = 0.0
    graph_memory_bytes: int = 0  # device memory taken by capture (pool + graph objects)
