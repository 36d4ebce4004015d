"""The fused MoE layer on CUDA (or under the Triton interpreter): three launches and a
sum, no host sync and no shape that depends on the routing, so a CUDA graph captures it.

1. `moe_align_kernel`: the (token, expert) pairs grouped by expert, padded to BLOCK_M;
2. `moe_gate_up_kernel`: one grouped GEMM over every expert's rows, SiLU-and-mul fused;
3. `moe_down_kernel`: one grouped GEMM, each row scaled by its routing weight;
4. the top-k sum: each token's k rows are adjacent ([T, k, H]); one reduction.

Buffers are sized for the worst case of a token count T (k pairs per token): at most
min(E, T * k) experts are picked, each padding fewer than BLOCK_M rows, so the padded
pairs fit in T * k + min(E, T * k) * (BLOCK_M - 1).
"""

from __future__ import annotations

import torch
import triton

from llmfast.kernels.moe import triton_kernels as kernels
from llmfast.kernels.moe.tile_table import MoeTiles, shape_key, tiles_for
from llmfast.kernels.triton_mode import triton_interpret_enabled

# Pairs per chunk the align kernel compares against every expert at once.
_ALIGN_CHUNK = 64


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted pair list in the worst case, a multiple of block_m."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def launch_tiles(x: torch.Tensor, num_experts: int, top_k: int, inter: int) -> MoeTiles:
    if triton_interpret_enabled() and not x.is_cuda:
        return tiles_for(None, "", 0, num_experts, top_k)
    key = shape_key(num_experts, top_k, x.shape[1], inter, str(x.dtype).removeprefix("torch."))
    return tiles_for(torch.cuda.get_device_name(x.device), key, x.shape[0], num_experts, top_k)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     tiles: MoeTiles | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k]; topk_ids [T, k]
    -> [T, H]. `tiles`: override the table (tuning, tests)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(x)
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the experts' weights must be contiguous along their rows")
    tiles = tiles or launch_tiles(x, num_experts, top_k, inter)
    num_pairs = num_tokens * top_k
    padded = max_padded_pairs(num_pairs, num_experts, tiles.block_m)
    num_blocks_m = padded // tiles.block_m
    device = x.device
    x = x.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32)  # [T * k], pair order
    weights = topk_weights.reshape(-1)  # [T * k]
    sorted_pairs = torch.empty(padded, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    kernels.moe_align_kernel[(num_experts,)](
        ids, sorted_pairs, block_experts, num_padded, num_pairs,
        BLOCK_M=tiles.block_m, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_P=_ALIGN_CHUNK,
    )
    interpreted = triton_interpret_enabled()
    upcast = interpreted and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                  GROUP_M=tiles.group_m, UPCAST=upcast, DOT_PRECISION=precision)
    if not interpreted:
        launch.update(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=device)
    kernels.moe_gate_up_kernel[(num_blocks_m * triton.cdiv(inter, tiles.block_n),)](
        x, w13, act, sorted_pairs, block_experts, num_padded, num_pairs, num_blocks_m,
        inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, **launch,
    )
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=device)  # [T * k, H]
    kernels.moe_down_kernel[(num_blocks_m * triton.cdiv(hidden, tiles.block_n),)](
        act, w2, out, weights, sorted_pairs, block_experts, num_padded, num_pairs,
        num_blocks_m, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        out.stride(0), **launch,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
