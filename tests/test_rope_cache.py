"""The rotary embedding fused into the KV write (attention/triton/rope_cache.py) and the attention
op that uses it: bit for bit what the rotary kernel, the KV write and the attention do
apart, in the Triton interpreter (a child process, as in test_attention_kernels.py), on
the CPU path, and compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from llmfast.config import RopeScaling
from llmfast.attention.triton import launch as attention
from llmfast.attention import ops
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.kernels.layers import rotary as rotary_ops
from llmfast.models.rope import rope_table
from tests.helpers.compiled import compiled_model

from tests import test_attention_kernels as attn_tests

SIGN = torch.tensor([[-1.0], [1.0]])


@pytest.fixture(scope="module")
def interpreter():
    yield from attn_tests.interpreter_child(__file__)


def _qkv(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as the model has them: views into one fused projection's rows."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    return q, k, v


# ----------------------------------------------------------------------------- child checks


def check_rope_and_cache(dtype: str, cache_dtype: str, heads: int, kv_heads: int,
                         head_dim: int, device: str = "cpu"):
    """q_out and the cache equal the rotary kernel's output and the KV write of it (bit
    for bit in the interpreter; on a GPU, where each kernel's compile may contract
    multiply-adds its own way, to one rounding); padding slots write nothing, slots no
    token names stay NaN."""
    dt, cdt = getattr(torch, dtype), getattr(torch, cache_dtype)
    tokens, block_size = 7, 16
    q, k, v = (t.to(device) for t in _qkv(tokens, heads, kv_heads, head_dim, dt))
    k = k * 300  # past fp8's +-448 after rotation for some: the clamp is exercised
    table = rope_table(head_dim, 64, 10000.0, RopeScaling()).to(device)
    positions = torch.tensor([0, 5, 63, 17, 2, 40, 9], device=device)
    slots = torch.tensor([3, 80, -1, 17, 95, -1, 0], device=device)
    shape = (6, block_size, kv_heads, head_dim)
    nan = torch.full(shape, float("nan"), device=device).to(cdt)
    k_cache, v_cache = nan.clone(), nan.clone()
    q_out = torch.full_like(q, float("nan")).contiguous()
    attention.rope_and_cache(q, k, v, positions, table, q_out, k_cache, v_cache, slots)

    sign = SIGN.to(device)
    want_q = rotary_ops.rotary_impl(positions, q, table, sign)  # the rotary kernel
    want_k = rotary_ops.rotary_impl(positions, k, table, sign)
    ref_k, ref_v = nan.clone(), nan.clone()
    attention.reshape_and_cache(want_k, v, ref_k, ref_v, slots)  # the KV write kernel
    if device == "cpu":
        attn_tests.assert_same_bits(q_out, want_q)
        _same_cache(k_cache, ref_k)
        _same_cache(v_cache, ref_v)
    else:
        _close_to_one_rounding(q_out, want_q, dt)
        _close_to_one_rounding(k_cache, ref_k, cdt)
        _same_cache(v_cache, ref_v)  # copied, not computed
    # And the oracle: the rotation in float64, rounded once.
    half = head_dim // 2
    cos = table.double()[positions][:, None, :half]
    sin = table.double()[positions][:, None, half:]
    x1, x2 = q.double()[..., :half], q.double()[..., half:]
    exact = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    assert (q_out.double() - exact).abs().max() <= 2 * _ULP[dt] * exact.abs().max()


# One unit in the last place, relative to the value: at most 2^-(explicit mantissa bits).
_ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10,
        torch.float8_e4m3fn: 2**-3}


def _close_to_one_rounding(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal NaN poison, and values within one unit in the last place of `dtype` of each
    other (two kernels computing the same rotation may round apart: the compiler fuses
    multiply-adds where it likes)."""
    a, b = a.float(), b.float()
    assert torch.equal(a.isnan(), b.isnan())
    a, b = a.nan_to_num(), b.nan_to_num()
    assert ((a - b).abs() <= _ULP[dtype] * b.abs() + 1e-6).all()


def check_fused_op_equals_unfused(dtype: str, kind: str, device: str = "cpu"):
    """The attention op given positions (rotating in its KV write, the queries in
    `out`, read and overwritten by the attention) = the op given rotated q and k (bit
    for bit in the interpreter; on a GPU to rounding, and right against float64)."""
    dt = getattr(torch, dtype)
    reqs = {"mixed": attn_tests.MIXED, "decode": [(40, 1), (3, 1), (17, 1), (0, 1)],
            # As many tokens as rows, but not uniform decode: a row whose last token is
            # still in flight gets none (async scheduling), another two.
            "zero_rows": [(40, 0), (3, 1), (17, 2)],
            "uniform": [(40, 1), (3, 1), (17, 1), (0, 1)],
            # Uniform decode with fewer tokens than rows (a row's last token in flight,
            # the live count a capture size, so no padding): the fused kernel, which
            # reads a key, value, slot and position per token, not per row.
            "uniform_zero_row": [(40, 0), (3, 1), (17, 1)]}[kind]
    pad = 1 if kind == "uniform" else 0 if "zero_row" in kind else 2
    b = attn_tests.make_batch(reqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                              dtype=dt, pad_tokens=pad, pad_reqs=min(pad, 1), device=device)
    # What the runner tells the op (AttentionMetadata.max_query_len): 1 only when every
    # row has at most one token; the op must not take shapes for it.
    max_query_len = torch.tensor([max(n for _, n in reqs)], dtype=torch.int32)
    if kind == "zero_rows":
        assert b["q"].shape[0] == b["seq_lens"].shape[0]
    num_tokens = b["q"].shape[0]
    table = rope_table(64, 128, 10000.0, RopeScaling()).to(device)
    # Each token's position in its sequence (padding tokens: 0).
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    starts = b["query_start_loc"].tolist()
    for r, seq_len in enumerate(b["seq_lens"].tolist()):
        n = starts[r + 1] - starts[r]
        positions[starts[r]: starts[r + 1]] = torch.arange(seq_len - n, seq_len)
    positions = positions.to(device)
    sign = SIGN.to(device)
    args = (b["block_table"], b["query_start_loc"], b["seq_lens"], b["scale"])

    k_fused, v_fused = b["k_cache"].clone(), b["v_cache"].clone()
    out_fused = torch.full_like(b["q"], float("nan"))
    before = {id(plan) for plan in attention._PLANS.values()}
    ops.unified_attention_impl(b["q"], b["k"], b["v"], k_fused, v_fused, b["slot_mapping"],
                               *args, out_fused, positions, table, max_query_len)
    fused_kernel = any(plan.rope for plan in attention._PLANS.values()
                       if id(plan) not in before)
    # Rows of <= 1 token: the fused decode kernel.
    assert fused_kernel == (kind in ("decode", "uniform", "uniform_zero_row")), kind
    q_rot = rotary_ops.rotary_impl(positions, b["q"], table, sign)
    k_rot = rotary_ops.rotary_impl(positions, b["k"], table, sign)
    k_apart, v_apart = b["k_cache"].clone(), b["v_cache"].clone()
    out_apart = torch.full_like(b["q"], float("nan"))
    ops.unified_attention_impl(q_rot, k_rot, b["v"], k_apart, v_apart, b["slot_mapping"],
                               *args, out_apart)
    n = starts[-1]
    assert torch.isfinite(out_fused[:n]).all()
    if device == "cpu":
        attn_tests.assert_same_bits(out_fused[:n], out_apart[:n])
        attn_tests.assert_same_bits(k_fused, k_apart)
        attn_tests.assert_same_bits(v_fused, v_apart)
        return
    _close_to_one_rounding(k_fused, k_apart, dt)
    attn_tests.assert_same_bits(v_fused, v_apart)
    # The float64 oracle over the rotated inputs: the fused op's rows are right.
    rotated = dict(b, q=q_rot, k=k_rot)
    attn_tests.assert_rel_close(out_fused[:n], attn_tests.reference_out(rotated)[:n],
                                attn_tests.TOL[dt])


def check_decode_rope_kernel(dtype: str, cache_dtype: str, num_splits: int | None,
                             num_sms: int | None = None, device: str = "cpu"):
    """A uniform decode step (one token per request; with a padding request and its
    padding token, num_tokens == num_reqs) given its new tokens: the one fused kernel
    (rotating q in registers, writing each new key and value from the split that reads
    it) = rope_and_cache then the attention kernel, outputs and caches bit for bit in the
    interpreter (on a GPU: to one rounding, and right against float64). Contexts from
    1 to 300 keys, forced splits, a request whose slot is -1 (a dummy run's: nothing
    written), an fp8 cache; with `num_sms` (an H100's 132) the split code is compiled in
    (a bound of 16) also where the launch does not split."""
    if num_sms is not None:
        sms, attention._num_sms = attention._num_sms, lambda device: num_sms
        try:
            return check_decode_rope_kernel(dtype, cache_dtype, num_splits, None, device)
        finally:
            attention._num_sms = sms
    dt = getattr(torch, dtype)
    reqs = [(40, 1), (3, 1), (17, 1), (0, 1), (299, 1), (15, 1)]
    b = attn_tests.make_batch(reqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                              dtype=dt, pad_tokens=1, pad_reqs=1, device=device)
    num_tokens, num_reqs = b["q"].shape[0], b["seq_lens"].shape[0]
    assert num_tokens == num_reqs
    cache_dt = getattr(torch, cache_dtype)
    k_cache, v_cache = b["k_cache"].to(cache_dt), b["v_cache"].to(cache_dt)
    slots = b["slot_mapping"].clone()
    slots[5] = -1  # the last real request writes nothing (its key stays NaN: read as is)
    positions = (b["seq_lens"][: len(reqs)].long() - 1).tolist() + [0]
    positions = torch.tensor(positions, dtype=torch.int64, device=device)
    table = rope_table(64, 512, 10000.0, RopeScaling()).to(device)
    args = (b["block_table"], b["query_start_loc"], b["seq_lens"], b["scale"])

    k_fused, v_fused = k_cache.clone(), v_cache.clone()
    out_fused = torch.full_like(b["q"], float("nan"))
    before = {id(plan) for plan in attention._PLANS.values()}
    attention.unified_attention(b["q"], k_fused, v_fused, *args, out_fused,
                                num_splits=num_splits,
                                new_tokens=(b["k"], b["v"], slots, positions, table),
                                uniform_decode=True)
    fresh = [plan for plan in attention._PLANS.values() if id(plan) not in before]
    assert fresh and all(plan.rope for plan in fresh)  # the fused kernel's launch

    k_apart, v_apart = k_cache.clone(), v_cache.clone()
    out_apart = torch.full_like(b["q"], float("nan"))
    attention.rope_and_cache(b["q"], b["k"], b["v"], positions, table, out_apart, k_apart,
                             v_apart, slots)
    attention.unified_attention(out_apart, k_apart, v_apart, *args, out_apart,
                                num_splits=num_splits)
    n = len(reqs)
    assert torch.isfinite(out_fused[:5]).all()  # the NaN key poisons request 5 only
    if device == "cpu":
        attn_tests.assert_same_bits(out_fused[:n], out_apart[:n])
        _same_cache(k_fused, k_apart)
        _same_cache(v_fused, v_apart)
        return
    _close_to_one_rounding(out_fused[:5], out_apart[:5], dt)
    _close_to_one_rounding(k_fused, k_apart, cache_dt)  # (an fp8 key: one fp8 step)
    _same_cache(v_fused, v_apart)


def check_model_steps_fused_equal_unfused():
    """A whole model (random:tiny, eager, Triton kernels under the interpreter): logits
    of prefill, chunk and decode steps with the rotation fused into the attention op
    equal those with the rotary kernel before it, bit for bit, and the torch CPU path's
    to float32 rounding."""
    from unittest import mock

    from llmfast.models import decoder
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.paged import PagedSequences

    steps = [{0: [5, 6, 7]}, {0: [8], 1: list(range(20, 31))}, {0: [9], 1: [12]}]
    fused_calls = []
    real = decoder.rope_fuses_into_attention

    def counting(*args):
        fused_calls.append(real(*args))
        return fused_calls[-1]

    def run(fuse: bool | None) -> list[torch.Tensor]:
        model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0)
        seqs = PagedSequences(model, 2, 32)
        if fuse is None:  # the plain CPU path: torch rotation and attention
            with mock.patch.object(ops, "use_triton", lambda x: False), \
                    mock.patch("llmfast.kernels.layers.kernel_choice.use_triton", lambda x: False):
                return [seqs.step(chunks) for chunks in steps]
        target = counting if fuse else (lambda *args: False)
        with mock.patch.object(decoder, "rope_fuses_into_attention", target):
            return [seqs.step(chunks) for chunks in steps]

    fused, apart, torch_path = run(True), run(False), run(None)
    assert fused_calls and all(fused_calls)  # every layer of every step took the fused path
    for a, b, c in zip(fused, apart, torch_path):
        attn_tests.assert_same_bits(a, b)
        assert (a - c).abs().max() <= 1e-4 * c.abs().max()


def check_attention_in_place(dtype: str, device: str = "cpu"):
    """The attention reading q from `out` and overwriting it (what the fused op does)
    is right with KV splits merged in the launch, merged by the second kernel, and in a
    mixed batch's decode region: no program reads rows another has overwritten."""
    dt = getattr(torch, dtype)
    cuda = device != "cpu"
    contexts = (6000, 8000, 2) if cuda else (150, 90, 2)
    decodes = [(c, 1) for c in contexts]
    group, block_n = 4, (128 if cuda else 16)
    shape = dict(num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=16, dtype=dt,
                 device=device)
    region = attention.DecodeRegion(16 // group if cuda else 2, block_n, 4)
    cases = [  # (requests, attention keyword arguments)
        (decodes, dict(config=attention.AttentionConfig(16 // group, block_n, 8, 4, 2,
                                                         min_split_tiles=1))),
        (decodes, dict(config=attention.AttentionConfig(16 // group, block_n, 8, 4, 2,
                                                         min_split_tiles=1),
                       fused_merge=False)),
        (decodes + [(20, 40), (0, 9)], dict(config=attention.AttentionConfig(
            16, block_n, 1, 4, 2, min_split_tiles=1, decode_region=region))),
    ]
    for reqs, kw in cases:
        b = attn_tests.make_batch(reqs, pad_tokens=1, **shape)
        k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
        attention.reshape_and_cache(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
        out = b["q"].clone()
        attention.unified_attention(out, k_cache, v_cache, b["block_table"],
                                    b["query_start_loc"], b["seq_lens"], b["scale"], out, **kw)
        n = int(b["query_start_loc"][-1])
        attn_tests.assert_rel_close(out[:n], attn_tests.reference_out(b)[:n],
                                    attn_tests.TOL[dt])


def check_engine_triton_path_equals_torch_path():
    """The whole engine (scheduler, runner, chunked prefill mixing chunks and decodes)
    with every Triton kernel in the interpreter (layer norms, RoPE in the KV write, the
    attention with its decode region and tile lookup) gives the torch path's greedy
    tokens. The fused RoPE and a launch with a decode region must have run."""
    from unittest import mock

    from llmfast.attention.triton import rope_cache
    from llmfast.llm import LLM
    from llmfast.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 5 for i in range(n)]}
               for j, n in enumerate((30, 3, 17, 1))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate() -> list[list[int]]:
        # A 24-token budget: the 30- and 17-token prompts are chunked beside decodes.
        llm = LLM("random:tiny", device="cpu", dtype="float32", max_num_batched_tokens=24,
                  max_num_seqs=4, max_model_len=128, seed=0)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]

    fused = []
    real = rope_cache.rope_and_cache
    with mock.patch.object(attention, "rope_and_cache",
                           lambda *a: fused.append(1) or real(*a)):
        triton_tokens = generate()
    with mock.patch.object(ops, "use_triton", lambda x: False), \
            mock.patch("llmfast.kernels.layers.kernel_choice.use_triton", lambda x: False):
        torch_tokens = generate()
    assert triton_tokens == torch_tokens
    assert fused, "the RoPE + KV-write kernel never ran"
    assert any(plan.constexprs["DECODE_REGION"] for plan in attention._PLANS.values())


# ----------------------------------------------------------------------------- tests


def test_engine_triton_path_equals_torch_path(interpreter):
    interpreter("check_engine_triton_path_equals_torch_path")



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_in_place(interpreter, dtype):
    interpreter("check_attention_in_place", dtype=dtype)



def test_model_steps_fused_equal_unfused(interpreter):
    interpreter("check_model_steps_fused_equal_unfused")



ROPE_CACHE_CASES = [
    ("bfloat16", "bfloat16", 8, 2, 64),
    ("float32", "float32", 5, 1, 128),  # heads not a power of two
    ("bfloat16", "float8_e4m3fn", 4, 4, 80),  # head dim padded inside; an fp8 cache
]
# The op's cases that rotate in the KV write, and those that take the fused decode
# kernel (on a GPU their tests are apart, so a failure names which).
FUSED_OP_CASES_KV_WRITE = [("float32", "mixed"), ("bfloat16", "mixed"),
                           ("bfloat16", "zero_rows")]
FUSED_OP_CASES_DECODE_KERNEL = [("bfloat16", "decode"), ("bfloat16", "uniform"),
                                ("bfloat16", "uniform_zero_row")]
FUSED_OP_CASES = FUSED_OP_CASES_KV_WRITE + FUSED_OP_CASES_DECODE_KERNEL


@pytest.mark.parametrize("dtype, cache_dtype, heads, kv_heads, head_dim", ROPE_CACHE_CASES)
def test_rope_and_cache_equals_rotary_then_kv_write(interpreter, dtype, cache_dtype, heads,
                                                    kv_heads, head_dim):
    interpreter("check_rope_and_cache", dtype=dtype, cache_dtype=cache_dtype, heads=heads,
                kv_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("dtype, kind", FUSED_OP_CASES)
def test_fused_op_equals_rotating_first(interpreter, dtype, kind):
    interpreter("check_fused_op_equals_unfused", dtype=dtype, kind=kind)


DECODE_ROPE_CASES = [("float32", "float32", None, None), ("bfloat16", "bfloat16", 4, None),
                     ("bfloat16", "float8_e4m3fn", 2, None), ("bfloat16", "bfloat16", 1, None),
                     ("bfloat16", "bfloat16", 1, 132), ("bfloat16", "bfloat16", None, 132)]


@pytest.mark.parametrize("dtype, cache_dtype, num_splits, num_sms", DECODE_ROPE_CASES)
def test_decode_rope_kernel_equals_rope_cache_then_attention(interpreter, dtype, cache_dtype,
                                                              num_splits, num_sms):
    interpreter("check_decode_rope_kernel", dtype=dtype, cache_dtype=cache_dtype,
                num_splits=num_splits, num_sms=num_sms)


@pytest.mark.gpu
def test_rope_and_cache_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for dtype, cache_dtype, heads, kv_heads, head_dim in ROPE_CACHE_CASES:
        check_rope_and_cache(dtype, cache_dtype, heads, kv_heads, head_dim, device="cuda")
    for dtype, kind in FUSED_OP_CASES_KV_WRITE:
        check_fused_op_equals_unfused(dtype, kind, device="cuda")
        torch.cuda.synchronize()
    for dtype in ("float32", "bfloat16"):
        check_attention_in_place(dtype, device="cuda")
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_decode_rope_kernel_on_cuda():
    # Its own test: when it fails, LLMFAST_ATTENTION_DECODE_ROPE=0 turns the fusion off
    # for the benchmarks after it.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for dtype, cache_dtype, num_splits, num_sms in DECODE_ROPE_CASES:
        check_decode_rope_kernel(dtype, cache_dtype, num_splits, num_sms, device="cuda")
        torch.cuda.synchronize()
    for dtype, kind in FUSED_OP_CASES_DECODE_KERNEL:  # the op's steps that take it
        check_fused_op_equals_unfused(dtype, kind, device="cuda")
        torch.cuda.synchronize()


def test_cpu_op_given_positions_rotates_with_the_reference():
    # Plain CPU (no Triton): the op rotates with the torch reference, then as before.
    b = attn_tests.make_batch([(5, 1), (0, 6)], num_heads=4, num_kv_heads=2, head_dim=32,
                              block_size=16, dtype=torch.float32, pad_tokens=1)
    table = rope_table(32, 16, 10000.0, RopeScaling())
    positions = torch.tensor([5, 0, 1, 2, 3, 4, 5, 0])
    args = (b["block_table"], b["query_start_loc"], b["seq_lens"], b["scale"])
    k1, v1, out1 = b["k_cache"].clone(), b["v_cache"].clone(), torch.zeros_like(b["q"])
    ops.unified_attention_impl(b["q"], b["k"], b["v"], k1, v1, b["slot_mapping"], *args, out1,
                               positions, table)
    q = rotary_ops.rotary_reference(positions, b["q"], table, SIGN)
    k = rotary_ops.rotary_reference(positions, b["k"], table, SIGN)
    k2, v2, out2 = b["k_cache"].clone(), b["v_cache"].clone(), torch.zeros_like(b["q"])
    ops.unified_attention_impl(q, k, b["v"], k2, v2, b["slot_mapping"], *args, out2)
    attn_tests.assert_same_bits(out1[:7], out2[:7])
    attn_tests.assert_same_bits(k1, k2)
    assert not torch.equal(q, b["q"])  # positions > 0 rotate


def test_compiled_model_passes_positions_through_the_split(monkeypatch, tmp_path):
    # The model asking the op to rotate (as on CUDA; on CPU the op then rotates with the
    # torch reference): Dynamo records the op with positions and the cos/sin table, the
    # backend splits there and the split graph calls the implementation with them; the
    # pieces hold no rotation. Logits equal eager's unfused ones to float32 rounding.
    from llmfast.config import CompileConfig
    from llmfast.models import decoder
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.paged import PagedSequences
    from tests.test_compile import STEPS, _CallThrough

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    eager_model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0)
    model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", seed=0)
    monkeypatch.setattr(decoder, "rope_fuses_into_attention", lambda *args: True)
    torch._dynamo.reset()
    cm = compiled_model(model, CompileConfig(), "cpu", max_num_tokens=64)
    eager_seqs, compiled_seqs = PagedSequences(eager_model, 4, 64), PagedSequences(model, 4, 64)
    compiled_seqs.model = _CallThrough(cm, model)
    for chunks in STEPS[:4]:
        compiled = compiled_seqs.step(chunks)
        with monkeypatch.context() as m:
            m.setattr(decoder, "rope_fuses_into_attention", lambda *args: False)
            eager = eager_seqs.step(chunks)
        assert (compiled - eager).abs().max() <= 1e-4 * eager.abs().max()
    split = cm.backend.split_gm
    calls = [n for n in split.graph.nodes if n.op == "call_module"]
    pieces = [split._modules[str(n.target)] for n in calls]
    attention_calls = [node for piece in pieces for node in piece.graph.nodes
                       if node.target is ops.unified_attention_impl]
    assert len(attention_calls) == model.config.num_hidden_layers
    # q, k, v, caches, metadata (4), scale, out, positions, cos_sin, max_query_len, window
    assert all(len(node.args) + len(node.kwargs) == 15 for node in attention_calls)
    called = {str(node.target) for piece in pieces for node in piece.graph.nodes
              if node.op == "call_function"}
    assert not any("rotary" in t for t in called), called  # no rotation in the pieces
    torch._dynamo.reset()


def test_opcheck_with_positions(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b = attn_tests.make_batch([(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=16,
                              block_size=16, dtype=torch.float32, pad_tokens=1)
    k_cache, v_cache = torch.nan_to_num(b["k_cache"]), torch.nan_to_num(b["v_cache"])
    torch.library.opcheck(
        torch.ops.llmfast.unified_attention.default,
        (b["q"], b["k"], b["v"], k_cache, v_cache, b["slot_mapping"], b["block_table"],
         b["query_start_loc"], b["seq_lens"], b["scale"], torch.zeros_like(b["q"]),
         torch.tensor([3, 0, 1, 2, 3, 0]), rope_table(16, 8, 10000.0, RopeScaling())),
    )


def test_rope_and_cache_compiles_for_sm90(monkeypatch):
    compiled = attn_tests.compile_launches_only(monkeypatch)
    monkeypatch.setattr("llmfast.attention.triton.rope_cache.check_launchable", lambda *args: None)
    with offline_hopper():
        for head_dim, cache_dtype in ((64, torch.bfloat16), (128, torch.float8_e4m3fn)):
            q, k, v = _qkv(8, 32, 8, head_dim, torch.bfloat16)
            cache = torch.empty(4, 16, 8, head_dim, dtype=cache_dtype)
            attention.rope_and_cache(q, k, v, torch.zeros(8, dtype=torch.int64),
                                     torch.empty(64, head_dim), torch.empty_like(q), cache,
                                     cache, torch.zeros(8, dtype=torch.int64))
    assert [name for name, _ in compiled] == ["_rope_and_cache_kernel"] * 2
    for _, kernel in compiled:
        assert "cubin" in kernel.asm


def _same_cache(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float8_e4m3fn:  # compared as bytes (NaN poison included)
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    attn_tests.assert_same_bits(a, b)


if __name__ == "__main__":
    attn_tests._serve(globals())
