"""The packed linear's prefill path (kernels/cpu/int4_dequant.py): the weight it unpacks
from the kernel's bytes against a naive loop over those bytes and against the GGUF
planes in float64, for every packed GGUF block type; its GEMM, whole and in row chunks,
against float64; its scratch reused and bounded."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from llmfast.kernels.cpu import int4_dequant
from llmfast.kernels.cpu.int4_dequant import (
    affine_maps,
    dequantized_linear,
    packed_layout_known,
    unpack_rows,
)
from llmfast.kernels.cpu.int4_linear import (
    DEQUANTIZE_MIN_TOKENS,
    Int4Linear,
    dequantize_planes,
    nibble_planes,
)
from llmfast.models.formats.gguf_blocks import PACKABLE_TYPES, decode_blocks
from tests.helpers.gguf_files import quantized_blocks

pytestmark = pytest.mark.skipif(not packed_layout_known(),
                                reason="this torch packs int4 weights in another layout")

ROWS, COLS = 72, 512  # 72: padded to 96 packed rows, three blocks of 32


def _codes(type_name: str, seed: int = 0):
    import gguf

    data = np.random.default_rng(seed).normal(0, 0.1, (ROWS, COLS)).astype(np.float32)
    raw = quantized_blocks(data, gguf.GGMLQuantizationType[type_name], seed)
    return decode_blocks(raw, type_name, COLS)


def _naive_unpack(layer: Int4Linear) -> np.ndarray:
    """float64 [N', K'] from the packed bytes, one (row, column) at a time in the loop's
    index maths: byte (b, k, l) of block b holds row 32 b + l in its low nibble and row
    32 b + 16 + l in its high one; w = (v - 8) * scale + zero with the bfloat16 maps."""
    packed = layer.weight_packed.numpy()
    rows, cols = packed.shape[0], packed.shape[1] * 2
    blocks = packed.reshape(rows // 32, cols, 16)
    sz = layer.scales_and_zeros.float().double().numpy()  # [K' / 32, N', 2]
    w = np.empty((rows, cols))
    for row in range(rows):
        b, half, lane = row // 32, (row % 32) // 16, row % 16
        for col in range(cols):
            v = (int(blocks[b, col, lane]) >> (4 * half)) & 15
            scale, zero = sz[col // 32, row]
            w[row, col] = (v - 8) * scale + zero
    return w


@pytest.mark.parametrize("type_name", PACKABLE_TYPES)
def test_unpacked_weight_is_the_naive_loops(type_name):
    codes = _codes(type_name)
    layer = Int4Linear.from_codes(codes)
    rows, cols = layer.weight_packed.shape[0], layer.weight_packed.shape[1] * 2
    scale, offset = affine_maps(layer.scales_and_zeros)
    weight, scratch = torch.empty(rows * cols), torch.empty(rows * cols, dtype=torch.uint8)
    want = _naive_unpack(layer)
    # Whole, and block by block into the same scratch (the chunks' path).
    got = unpack_rows(layer.weight_packed, scale, offset, 0, rows, weight, scratch)  # [K', N']
    np.testing.assert_allclose(got.t().double().numpy(), want, rtol=1e-6, atol=1e-7)
    for start in range(0, rows, 32):
        got = unpack_rows(layer.weight_packed, scale, offset, start, start + 32, weight,
                          scratch)
        np.testing.assert_allclose(got.t().double().numpy(), want[start:start + 32],
                                   rtol=1e-6, atol=1e-7)
    # The planes' own float64 weight (bfloat16 maps) is the same, folded onto x's columns.
    values, sz, x_index = nibble_planes(codes)
    planes = dequantize_planes(values, torch.from_numpy(sz).bfloat16().float().numpy(),
                               x_index, COLS)
    folded = np.zeros((ROWS, COLS + 1))
    index = np.arange(cols) if layer.x_index is None else layer.x_index.numpy()
    np.add.at(folded.T, index, want[:ROWS].T)
    np.testing.assert_allclose(folded[:, :COLS], planes, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", PACKABLE_TYPES)
@pytest.mark.parametrize("chunk_elements", [None, 32 * 1024])
def test_dequantized_linear_matches_float64(type_name, chunk_elements, monkeypatch):
    """Whole, and in chunks of 32 rows (2 or 4 planes of 512 columns: 32-64 K floats):
    x @ W.T within float32 rounding of the float64 product over the planes' weight."""
    if chunk_elements is not None:
        monkeypatch.setattr(int4_dequant, "SCRATCH_ELEMENTS", chunk_elements)
    codes = _codes(type_name, seed=3)
    layer = Int4Linear.from_codes(codes)
    values, sz, x_index = nibble_planes(codes)
    weight = torch.from_numpy(dequantize_planes(
        values, torch.from_numpy(sz).bfloat16().float().numpy(), x_index, COLS))  # [N, K]
    x = torch.randn(40, COLS)
    got = dequantized_linear(x, layer.weight_packed, layer.scales_and_zeros, layer.x_index,
                             layer.zero_column, ROWS)
    assert got.shape == (40, ROWS) and got.dtype == torch.float32
    want = x.double() @ weight.T
    bound = 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-6
    assert ((got.double() - want).abs() <= bound).all()
    # A bfloat16 model's activations: computed in float32, returned in bfloat16.
    half = dequantized_linear(x.bfloat16(), layer.weight_packed, layer.scales_and_zeros,
                              layer.x_index, layer.zero_column, ROWS)
    assert half.dtype == torch.bfloat16
    want = x.bfloat16().double() @ weight.T
    assert ((half.double() - want).abs() <= 2.0**-7 * want.abs() + bound).all()


def test_scratch_is_reused_and_bounded(monkeypatch):
    """One float32 scratch per thread, reused by every call that fits it, never grown
    past SCRATCH_ELEMENTS: a weight of more rows goes through in chunks."""
    monkeypatch.setattr(int4_dequant, "SCRATCH_ELEMENTS", 64 * COLS)
    small = Int4Linear.from_codes(_codes("Q4_0"))  # 96 packed rows x 512
    big = Int4Linear.from_codes(_codes("Q8_0"))  # two planes: 96 x 1024 (chunks of 32 rows)
    seen = []

    def run():
        x = torch.randn(max(DEQUANTIZE_MIN_TOKENS, 1), COLS)  # the prefill path
        for layer in (small, big, small):
            layer(x)
            scratch = int4_dequant._SCRATCH.weight
            seen.append((scratch.data_ptr(), scratch.numel()))

    thread = threading.Thread(target=run)  # a fresh thread: a fresh scratch
    thread.start()
    thread.join()
    assert len(seen) == 3
    assert all(numel <= 64 * COLS for _, numel in seen)
    assert seen[0] == seen[1] == seen[2]
