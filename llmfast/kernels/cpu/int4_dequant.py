"""Prefill-sized calls of a packed int4 linear (int4_linear.py): the weight unpacked from
the kernel's packed bytes to float32, a chunk of rows at a time, into a scratch buffer
reused across layers and steps, each chunk followed by its float32 GEMM.

torch's int4 kernel costs about as much per token as per weight read (a GEMV at heart),
so from DEQUANTIZE_MIN_TOKENS tokens an unpack of the whole weight plus MKL's float32
GEMM costs less. The unpack is four eager ops into the weight's transpose
(`unpack_rows`): 1.6 ms for the default model's gate_up (3072 x 576) on the 2-core AVX2
VM, 1 thread, against 2.5 ms for the former per-call unpack into the weight's own layout
(scripts/bench_cpu_quant.py --unpack; profiles/cpu.md, "Prefill"). Measured there and
not kept:
- other eager orders (the nibbles split as int64 words, mul + add instead of addcmul,
  the offset folded into the GEMM through x's group sums): the same or slower; a scale
  strided along N' (the bfloat16 pairs' float view as is) halves the unpack's speed;
- chunks of 1 MiB or less (to keep the float32 chunk in L2 for its GEMM): slower, the
  op calls per chunk cost more than the misses they save (128 KiB: 1.7-3.7x slower);
- torch.compile (Inductor C++) of the unpack: one fused loop, but one that loads 8 bytes
  a vector through a partial load: 0.55-0.69 ms for 576 x 576 against 0.50 for the
  former eager unpack, after a cold compile of 2-22 s per weight shape (Inductor's
  import ~3 s of it);
- bfloat16 weights and activations: oneDNN's GEMM 4-6x slower than float32 on AVX2.
The scratch also bounds the unpack: a layer larger than SCRATCH_ELEMENTS (a tied
lm_head on many sampled rows: 49152 x 1152 planes, 226 MB as one tensor plus 113 MB
folded, before) goes through in chunks of that size.
"""

from __future__ import annotations

import functools
import threading

import torch

# Columns per scale/zero pair (the kernel's group) and rows per block of its layout.
GROUP = 32
BLOCK_ROWS = 32
# The float32 scratch's size in weights (8 MiB): the default model's gate_up whole.
SCRATCH_ELEMENTS = 1 << 21


class _Scratch(threading.local):
    """Per thread (two engines' threads never share it): the float32 weight chunk and the
    bytes it is unpacked through, grown to the largest chunk seen."""

    def __init__(self) -> None:
        self.weight = torch.empty(0)
        self.codes = torch.empty(0, dtype=torch.uint8)

    def buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.weight.numel() < numel:
            self.weight = torch.empty(numel)
            self.codes = torch.empty(numel, dtype=torch.uint8)
        return self.weight, self.codes


_SCRATCH = _Scratch()


def affine_maps(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[K' / 32, N', 2] (the kernel's scales and zeros) -> scale, offset float32
    [K' / 32, 1, N'], contiguous along N' (a strided one halves the unpack's speed), with
    w = v * scale + offset (the kernel's (v - 8) scale + zero)."""
    sz = scales_and_zeros.float().permute(2, 0, 1)  # [2, K' / 32, N']
    scale = sz[0].contiguous()
    return scale.unsqueeze(1), torch.add(sz[1], scale, alpha=-8).unsqueeze(1)


def unpack_rows(weight_packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                start: int, stop: int, weight: torch.Tensor,
                codes: torch.Tensor) -> torch.Tensor:
    """float32 [K', stop - start] in `weight`'s first elements: the transpose of rows
    start:stop (whole blocks of 32) of the weight the packed planes stand for; `codes`
    is byte scratch for as many elements.

    The kernel's layout (torch 2.13, `_convert_weight_to_int4pack_for_cpu`, checked by
    `packed_layout_known` and tests/test_int4_dequant.py): blocks of 32 rows, as
    [N' / 32, K', 16] bytes whose low nibble is row 32 b + l and high nibble row 32 b + 16 + l.
    The transpose is what makes the unpack cheap: both nibble planes are split off whole
    (two contiguous byte ops), then one conversion copy reads 16 bytes and writes 16
    floats at a time, where the weight's own layout needs a transposing copy per plane
    (1.3-1.8x the time for the whole unpack); MKL's GEMM reads either layout as fast.
    """
    rows, cols = stop - start, weight_packed.shape[1] * 2
    blocks = rows // BLOCK_ROWS
    packed = weight_packed[start:stop].view(blocks, cols, 16)
    planes = codes[:rows * cols].view(blocks, 2, cols, 16)  # [block, nibble, k, lane]
    torch.bitwise_and(packed, 15, out=planes[:, 0])
    torch.bitwise_right_shift(packed, 4, out=planes[:, 1])
    w_t = weight[:rows * cols].view(cols, blocks, 2, 16)  # [k, row = (block, nibble, lane)]
    w_t.copy_(planes.permute(2, 0, 1, 3))  # converts to float32
    grouped = w_t.view(cols // GROUP, GROUP, rows)
    torch.addcmul(offset[..., start:stop], grouped, scale[..., start:stop], out=grouped)
    return w_t.view(cols, rows)


def chunk_rows(cols: int) -> int:
    """Rows per chunk: whole blocks filling SCRATCH_ELEMENTS (at least one block)."""
    return max(BLOCK_ROWS, SCRATCH_ELEMENTS // cols // BLOCK_ROWS * BLOCK_ROWS)


def plane_columns(x: torch.Tensor, x_index: torch.Tensor | None,
                  zero_column: bool) -> torch.Tensor:
    """x [M, K] -> [M, K']: x's columns gathered to the packed planes' (int4_linear.py's
    `nibble_planes`: a column per plane, K meaning a zero column); x itself for one plane."""
    if x_index is None:
        return x
    if zero_column:
        x = torch.nn.functional.pad(x, (0, 1))
    return x.index_select(1, x_index)


def dequantized_linear(x: torch.Tensor, weight_packed: torch.Tensor,
                       scales_and_zeros: torch.Tensor, x_index: torch.Tensor | None,
                       zero_column: bool, out_features: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: float32 GEMMs on the weight unpacked chunk by
    chunk. Planes beyond the first (codes of 5-8 bits, groups of 16) are not folded back
    onto x's columns: x's columns are gathered to the planes' K' instead (M x K', smaller
    than the weight), as for the kernel."""
    dtype = x.dtype
    x = plane_columns(x.float(), x_index, zero_column)  # [M, K']
    cols = weight_packed.shape[1] * 2
    needed = -(-out_features // BLOCK_ROWS) * BLOCK_ROWS  # padded rows past it: unused
    step = chunk_rows(cols)
    scale, offset = affine_maps(scales_and_zeros)
    weight, codes = _SCRATCH.buffers(min(step, needed) * cols)
    if needed <= step:
        w_t = unpack_rows(weight_packed, scale, offset, 0, needed, weight, codes)
        return torch.mm(x, w_t[:, :out_features]).to(dtype)
    out = x.new_empty(x.shape[0], out_features)
    for start in range(0, needed, step):
        stop = min(start + step, needed)
        w_t = unpack_rows(weight_packed, scale, offset, start, stop, weight, codes)
        end = min(stop, out_features)
        torch.mm(x, w_t[:, :end - start], out=out[:, start:end])
    return out.to(dtype)


def dequantize_packed(weight_packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                      x_index: torch.Tensor | None, in_features: int,
                      out_features: int) -> torch.Tensor:
    """float32 [N, K], a new tensor: the weight the kernel's packed planes stand for
    (scales and zeros as the kernel reads them, in bfloat16), the planes folded back onto
    x's columns (what tests compare with the GGUF blocks)."""
    rows, cols = weight_packed.shape[0], weight_packed.shape[1] * 2
    if rows % BLOCK_ROWS:
        raise ValueError(f"{rows} packed rows: not whole blocks of {BLOCK_ROWS}")
    scale, offset = affine_maps(scales_and_zeros)
    w = unpack_rows(weight_packed, scale, offset, 0, rows, torch.empty(rows * cols),
                    torch.empty(rows * cols, dtype=torch.uint8)).t()[:out_features]
    if x_index is None:
        return w.contiguous()
    folded = w.new_zeros(out_features, in_features + 1)  # the last: the zero column
    return folded.index_add_(1, x_index, w)[:, :in_features]


@functools.cache
def packed_layout_known() -> bool:
    """Whether this torch packs as `unpack_rows` reads (checked once on a probe; where
    not, every call takes the kernel)."""
    values = torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64) * 7 % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    if packed.shape != (64, 32) or packed.dtype != torch.uint8:
        return False
    sz = torch.zeros(2, 64, 2, dtype=torch.bfloat16)
    sz[..., 0] = 1
    sz[..., 1] = 8  # w = v - 8 + 8 = v
    return torch.equal(dequantize_packed(packed, sz, None, 64, 64), values.float())
