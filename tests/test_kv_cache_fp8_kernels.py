"""`--kv-cache-dtype fp8`: the KV write and every attention path over a float8_e4m3fn
cache, against float64 oracles.

Oracles: the write stores `clamp(x, -448, 448).to(float8_e4m3fn)` bit for bit; attention
equals ops.py's float64 reference computed on the dequantized cache (scale 1.0) after
that write. The kernel checks run under the Triton interpreter in a child process, as
tests/test_attention_kernels.py explains (whose helpers and tolerances they reuse); the
CPU path and the launch keys run here.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from llmfast.attention.triton import launch as attention
from llmfast.attention.triton import kv_write
from llmfast.attention import ops
from llmfast.attention.triton.kv_write import _cache_value
from llmfast.attention.cpu import paged_attention_cpu
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.attention.tuning import prefill_measure
from llmfast.attention.tuning.prefill_tuning import (
    ShapeClass,
    kv_dtype_name,
    parse_kv_dtype_name,
    shape_class,
)
from tests import test_attention_kernels as base
from tests.test_attention_kernels import (
    MIXED,
    TOL,
    assert_rel_close,
    make_batch,
    reference_out,
    run_triton_step,
)

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def interpreter():
    """The interpreter child of test_attention_kernels.py, serving this module's checks."""
    yield from base.interpreter_child(__file__)


# ----------------------------------------------------------------------------- helpers


def expected_fp8(x: torch.Tensor) -> torch.Tensor:
    """The specified write: clamped to e4m3fn's finite range, then rounded."""
    return x.float().clamp(-448.0, 448.0).to(FP8)


def fp8_batch(reqs, *, dtype: torch.dtype, **kw) -> dict:
    """make_batch's step with its caches in fp8 (the NaN poison stays NaN) and new K/V
    scaled so that some values lie past 448 (the clamp) and some in fp8's subnormals."""
    b = make_batch(reqs, dtype=dtype, **kw)
    for name in ("k_cache", "v_cache"):
        b[name] = b[name].to(FP8)
    for name in ("k", "v"):
        x = b[name].float()
        x[::3, 0, :4] *= 400.0  # past 448 where |x| > 1.12: clamped
        x[1::3, -1, :4] *= 1e-3  # fp8 subnormals (< 2^-6)
        b[name] = x.to(dtype)
    return b


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal fp8 values, NaN included; -0 equals +0 (the Triton interpreter's fp8
    conversion drops the sign of zero, a GPU keeps it: the same value to every reader)."""
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_fp8_step(b: dict, dtype: torch.dtype, **kw) -> None:
    out, k_cache, v_cache = run_triton_step(b, **kw)
    ref_k, ref_v = b["k_cache"].clone(), b["v_cache"].clone()
    ops.reshape_and_cache_reference(b["k"], b["v"], ref_k, ref_v, b["slot_mapping"])
    assert same_bytes(k_cache, ref_k) and same_bytes(v_cache, ref_v)
    n = int(b["query_start_loc"][-1])
    assert_rel_close(out[:n], reference_out(b)[:n], TOL[dtype])


# ----------------------------------------------------------------------------- child checks


def check_write(dtype: str):
    """Every fp8 rounding case: binade edges (127.3 rounds up to 128), ties, values past
    448 (and past the largest value that would round to it), subnormals, zero."""
    torch.manual_seed(0)
    special = torch.tensor([1000.0, -1000.0, 448.0, 449.0, 464.0, -470.0, 127.3, -127.9,
                            2**-6, 2**-7, 2**-9, 3 * 2**-10, 2**-10, 2**-11, 1e-6, 0.0,
                            1.0625, 1.1875, 255.9, -0.0])
    values = torch.cat([torch.randn(2000) * 60.0, torch.randn(500) * 0.01, special])
    values = values[: values.numel() // 24 * 24].to(getattr(torch, dtype))
    k = values.view(-1, 3, 8)  # [tokens, kv heads, head dim]
    v = -k.flip(0)
    num_tokens = k.shape[0]
    k_cache = torch.full((num_tokens // 4 + 2, 4, 3, 8), float("nan"), dtype=FP8)
    v_cache = k_cache.clone()
    slots = torch.randperm(k_cache.shape[0] * 4)[:num_tokens]
    slots[::7] = -1  # padding tokens: not written
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    live = slots >= 0
    ref_k.view(-1, 3, 8).view(torch.uint8)[slots[live]] = expected_fp8(k[live]).view(torch.uint8)
    ref_v.view(-1, 3, 8).view(torch.uint8)[slots[live]] = expected_fp8(v[live]).view(torch.uint8)
    cpu_k, cpu_v = k_cache.clone(), v_cache.clone()
    attention.reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert same_bytes(k_cache, ref_k) and same_bytes(v_cache, ref_v)
    assert not torch.isnan(k_cache.float().view(-1, 3, 8)[slots[live]]).any()
    # The CPU path's write (ops.py's reference) is the same.
    ops.reshape_and_cache_reference(k, v, cpu_k, cpu_v, slots)
    assert same_bytes(cpu_k, ref_k) and same_bytes(cpu_v, ref_v)


# NaN bit patterns, quiet and signalling-style payloads of both signs, the all-ones
# payload among them (0x7FFFFFFF: what a GPU's NaN-propagating max returns, whatever
# NaN went in).
NAN_BITS = {"float32": (0x7FFFFFFF, 0x7FC00000, -1, -0x3FFFFF, 0x7F800001),
            "bfloat16": (0x7FFF, 0x7FC0, -1, -0x7F, 0x7F81)}


def nan_keys(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """[4, 3, 8] keys with every NAN_BITS pattern twice among normal values."""
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    k = torch.randn(4, 3, 8, dtype=dtype) * 10
    nans = torch.tensor(NAN_BITS[str(dtype).removeprefix("torch.")], dtype=int_dtype)
    k.view(-1)[: nans.numel()] = nans.view(dtype)
    k.view(-1)[-nans.numel():] = nans.view(dtype)
    assert k.isnan().sum() == 2 * nans.numel()
    return k.to(device)


@triton.jit
def cache_values(x_ptr, out_ptr, n, N: tl.constexpr, CLAMP: tl.constexpr):
    """out = what an fp8 KV write stores for x, before the store's conversion."""
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _cache_value(x, CLAMP), mask=offs < n)


def check_write_nan(dtype: str):
    """What an fp8 KV write stores before the store's conversion: a NaN stays NaN
    whatever its bits (the write's rounding works on the bits: a NaN whose payload is
    all ones came out of it as -0), every other value clamped and rounded as expected.
    (The interpreter's float32 -> fp8 conversion garbles NaN, a GPU's gives NaN: the
    stored bytes are checked on a GPU, test_kv_cache_fp8_gpu.py.)"""
    x = nan_keys(getattr(torch, dtype)).view(-1)
    out = torch.empty(x.numel(), dtype=torch.float32)
    cache_values[(1,)](x, out, x.numel(), N=triton.next_power_of_2(x.numel()), CLAMP=448.0)
    assert torch.equal(out.isnan(), x.isnan())
    finite = ~x.isnan()
    assert torch.equal(out[finite], expected_fp8(x[finite]).float())


def check_mixed(dtype: str, group: int, head_dim: int, block_size: int, **kw):
    torch_dtype = getattr(torch, dtype)
    b = fp8_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                  block_size=block_size, dtype=torch_dtype, pad_tokens=3, pad_reqs=1)
    check_fp8_step(b, torch_dtype, **kw)


def check_decode(dtype: str, **kw):
    torch_dtype = getattr(torch, dtype)
    b = fp8_batch([(150, 1), (3, 1), (70, 1), (0, 1)], num_heads=8, num_kv_heads=2,
                  head_dim=64, block_size=16, dtype=torch_dtype, pad_tokens=1)
    check_fp8_step(b, torch_dtype, **kw)


def check_prefill(dtype: str, ctx: int, num_new: int, **kw):
    torch_dtype = getattr(torch, dtype)
    b = fp8_batch([(ctx, num_new)], num_heads=4, num_kv_heads=2, head_dim=64,
                  block_size=16, dtype=torch_dtype)
    check_fp8_step(b, torch_dtype, **kw)


def check_op_dispatch():
    """The custom op (KV write, then attention) on an fp8 cache, through Triton."""
    base.check_op_dispatch(fp8_batch)


def check_tuner_batch():
    """The tuner's synthetic batch of an fp8 cache class has an fp8 cache."""
    prefill_measure.CAUSAL_TOKENS, prefill_measure.KV_HEADS = 40, 2
    b = prefill_measure.synthetic_batch(ShapeClass(32, 2, "float32kvfp8", "causal"),
                                        torch.device("cpu"))
    assert b["k_cache"].dtype == FP8 and b["q"].dtype == torch.float32
    ref = torch.zeros(b["q"].shape, dtype=torch.float64)
    ops.paged_attention_reference(b["q"], b["k_cache"], b["v_cache"], b["block_table"],
                                  b["query_start_loc"], b["seq_lens"], b["scale"], ref,
                                  compute_dtype=torch.float64)
    attention.unified_attention(**b)
    assert_rel_close(b["out"], ref, TOL[torch.float32])


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_is_clamped_fp8_rounding(interpreter, dtype):
    interpreter("check_write", dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_keeps_nan(interpreter, dtype):
    interpreter("check_write_nan", dtype=dtype)


@pytest.mark.parametrize("dtype, group, head_dim, block_size, kw", [
    ("float32", 1, 64, 16, {}),
    ("bfloat16", 4, 128, 16, {"block_q": 2}),
    ("float16", 3, 64, 32, {"block_q": 4}),
    ("float32", 2, 80, 16, {"block_q": 4}),  # head_dim padded inside the kernel
    ("float16", 4, 64, 16, {"block_q": 4, "num_splits": 2}),  # split prefill tiles
])
def test_mixed_batch(interpreter, dtype, group, head_dim, block_size, kw):
    interpreter("check_mixed", dtype=dtype, group=group, head_dim=head_dim,
                block_size=block_size, **kw)


@pytest.mark.parametrize("dtype, kw", [
    ("float32", {}),
    ("bfloat16", {}),
    ("float32", {"num_splits": 4}),  # split-KV, merged in the launch
    ("bfloat16", {"num_splits": 8, "fused_merge": False}),  # merged by the second kernel
])
def test_decode(interpreter, dtype, kw):
    interpreter("check_decode", dtype=dtype, **kw)


@pytest.mark.parametrize("dtype, ctx, num_new", [
    ("float32", 0, 40), ("bfloat16", 0, 33), ("float32", 20, 24)])
def test_prefill_causal(interpreter, dtype, ctx, num_new):
    interpreter("check_prefill", dtype=dtype, ctx=ctx, num_new=num_new)


def test_op_dispatch(interpreter):
    interpreter("check_op_dispatch")


def test_tuner_synthetic_batch(interpreter):
    interpreter("check_tuner_batch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_path(dtype, seed):
    """The CPU path (reference write + vectorised attention) on an fp8 cache: the write
    is the specified rounding and attention equals float64 on the dequantized cache."""
    b = fp8_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                  dtype=dtype, pad_tokens=2, seed=seed)
    for name in ("k_cache", "v_cache"):  # the CPU path masks with -inf: no NaN slots
        b[name] = b[name].float().nan_to_num(0.0).to(FP8)
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    out = torch.full_like(b["q"], float("nan"))
    ops.unified_attention_impl(b["q"], b["k"], b["v"], k_cache, v_cache, b["slot_mapping"],
                               b["block_table"], b["query_start_loc"], b["seq_lens"],
                               b["scale"], out)
    live = b["slot_mapping"] >= 0
    written = k_cache.view(-1, 2, 32)[b["slot_mapping"][live]]
    assert same_bytes(written, expected_fp8(b["k"][: live.numel()][live]))
    n = int(b["query_start_loc"][-1])
    assert_rel_close(out[:n], reference_out(b)[:n], TOL[dtype])
    # The kernels' own CPU attention alone, on the written cache.
    again = torch.full_like(out, float("nan"))
    paged_attention_cpu(b["q"], k_cache, v_cache, b["block_table"], b["query_start_loc"],
                        b["seq_lens"], b["scale"], again)
    assert torch.equal(again[:n], out[:n])


def test_fp8_cache_gets_its_own_launch_variant_and_table_keys():
    """A plan (and the compiled kernel it names) for a bf16 cache is never reused for an
    fp8 one of the same shapes; tuning tables key the cache dtype too."""
    b = make_batch([(20, 1), (0, 5)], num_heads=4, num_kv_heads=2, head_dim=32,
                   block_size=16, dtype=torch.bfloat16)
    args = (b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["q"], 2, None, None,
            True, None)
    bf16_plan = attention._plan(*args)
    fp8_cache = b["k_cache"].to(FP8)
    fp8_plan = attention._plan(b["q"], fp8_cache, fp8_cache, *args[3:])
    assert bf16_plan.constexprs["CONVERT_KV"] is False
    assert fp8_plan.constexprs["CONVERT_KV"] is True
    assert bf16_plan.const_key != fp8_plan.const_key
    with pytest.raises(ValueError, match="v_cache"):
        attention._plan(b["q"], fp8_cache, b["v_cache"], *args[3:])
    assert kv_dtype_name(torch.bfloat16, torch.bfloat16) == "bfloat16"
    assert kv_dtype_name(torch.bfloat16, FP8) == "bfloat16kvfp8"
    assert parse_kv_dtype_name("float16kvfp8") == (torch.float16, FP8)
    assert parse_kv_dtype_name("float16") == (torch.float16, torch.float16)
    cls = shape_class(1, 128, 4, torch.bfloat16, FP8)
    assert cls.key == "hd128-g4-bfloat16kvfp8-causal" and ShapeClass.from_key(cls.key) == cls
    assert cls != shape_class(1, 128, 4, torch.bfloat16)
    assert kv_write.cache_clamp(FP8) == 448.0 and kv_write.cache_clamp(torch.bfloat16) == 0.0


def test_fp8_kernels_compile_for_sm90(monkeypatch):
    """The fp8-cache variants (write, decode with splits, prefill) compile to a cubin for
    an H100 through the real launch path (the numerics are the interpreter's above)."""
    compiled = base.compile_launches_only(monkeypatch)
    with offline_hopper():
        for num_tokens, num_reqs, num_splits in ((8, 8, 8), (512, 2, 1)):
            q = torch.empty(num_tokens, 32, 128, dtype=torch.bfloat16)
            k = torch.empty(num_tokens, 8, 128, dtype=torch.bfloat16)
            k_cache = torch.empty(4, 16, 8, 128, dtype=FP8)
            attention.reshape_and_cache(k, k, k_cache, k_cache,
                                        torch.empty(num_tokens, dtype=torch.int64))
            attention.unified_attention(
                q, k_cache, k_cache, torch.empty(num_reqs, 128, dtype=torch.int32),
                torch.empty(num_reqs + 1, dtype=torch.int32),
                torch.empty(num_reqs, dtype=torch.int32), 0.1, q, num_splits=num_splits)
    names = [name for name, _ in compiled]
    assert names.count("_unified_attention_kernel") == 2, names
    assert "_reshape_and_cache_kernel" in names
    for name, kernel in compiled:
        assert "cubin" in kernel.asm, name


if __name__ == "__main__":
    base._serve(globals())
