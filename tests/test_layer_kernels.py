"""The decoder's RMSNorm (with and without the residual add) and RoPE Triton kernels
(kernels/layers/triton_kernels.py), run under the Triton interpreter in a child process, against
float64 oracles written out here and against the torch references the CPU path runs.
Plus: the ops register only when asked (no Inductor/Dynamo import at model import), and
eager CPU calls take the torch reference."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmfast.kernels.layers import rms_norm as norm_ops
from llmfast.kernels.layers import rotary as rotary_ops
from tests.test_attention_kernels import _serve, interpreter_child

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreter_child(__file__)


def _within_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float):
    """|got - want| <= ulps * ulp(dtype) * max(|want|, 1e-2): relative to each element."""
    err = (got.double() - want.double()).abs()
    bound = ulps * ULP[dtype] * want.double().abs().clamp_min(1e-2)
    assert torch.isfinite(got).all()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} x the bound"


# ----------------------------------------------------------------------------- child checks


def check_rms_norm(dtype: str, rows: int, cols: int, residual: bool, row_stride: int,
                   device: str = "cpu", offset: bool = False):
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(rows * 7 + cols)
    # Inputs as views with a row stride past their width (a slice of a wider buffer).
    x = torch.randn(rows, row_stride, generator=gen).mul(3).to(dt)[:, :cols].to(device)
    r = torch.randn(rows, row_stride, generator=gen).to(dt)[:, :cols].to(device)
    w = torch.rand(cols, generator=gen).add(0.5).to(dt).to(device)
    if offset:  # Gemma's weights are offsets from 1
        w = w - 1.0
    eps = 1e-5
    if residual:
        out, summed = norm_ops.add_rms_norm_impl(x, r, w, eps, offset)
        # The residual sum in the model dtype: exactly as torch rounds it on a GPU, within
        # one unit roundoff under the interpreter (see below).
        if device == "cuda":
            assert torch.equal(summed, x + r)
        else:
            _within_ulps(summed, (x.double() + r.double()), dt, 2.0)
        src = summed  # the norm of the sum the kernel stored (checked just above)
        ref = norm_ops.rms_norm_reference(src, w, eps, offset)
    else:
        out = norm_ops.rms_norm_impl(x, w, eps, offset)
        src = x
        ref = norm_ops.rms_norm_reference(x, w, eps, offset)
    assert out.shape == x.shape and out.dtype == dt
    s = src.double()
    scale = w.double() + 1.0 if offset else w.double()
    exact = scale * (s / (s.pow(2).mean(-1, keepdim=True) + eps).sqrt())
    # Two roundings to dt (the normalised value, then the scaled one), each within one
    # unit roundoff on a GPU (nearest-even) and two under the interpreter (whose
    # float32 -> bfloat16 conversion may truncate), and float32 maths.
    _within_ulps(out, exact, dt, 4.5)
    _within_ulps(out, ref.to(dt), dt, 4.5)  # the CPU path agrees to rounding


def check_rotary(dtype: str, tokens: int, heads: int, head_dim: int, device: str = "cpu"):
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(tokens + heads)
    from llmfast.config import RopeScaling
    from llmfast.models.rope import rope_table

    table = rope_table(head_dim, 64, 10000.0, RopeScaling()).to(device)
    sign = torch.tensor([[-1.0], [1.0]], device=device)
    # Queries and keys as the model passes them: a view into qkv rows with v after them.
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(dt).to(device)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    positions[0] = 0
    positions = positions.to(device)
    out = rotary_ops.rotary_impl(positions, x, table, sign)
    assert out.shape == x.shape and out.dtype == dt and out.is_contiguous()
    # The oracle: the rotation in float64 by the table's cos and sin (the table itself
    # is checked against cos/sin of position * frequency in test_weight_loading.py).
    half = head_dim // 2
    cos, sin = table.double()[positions][:, None, :half], table.double()[positions][:, None, half:]
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    exact = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    scale = exact.abs().max().item()
    # One rounding to dt: half an ulp on a GPU, up to one under the interpreter.
    assert (out.double() - exact).abs().max().item() <= 2 * ULP[dt] * scale
    ref = rotary_ops.rotary_reference(positions, x, table, sign)
    assert (out.double() - ref.double()).abs().max().item() <= 2 * ULP[dt] * scale
    assert torch.equal(out[0], x[0])  # position 0: no rotation at all


# ----------------------------------------------------------------------------- tests


RMS_NORM_CASES = [
    ("bfloat16", 1, 2048, False, 2048), ("bfloat16", 5, 2048, True, 3072),
    ("float32", 3, 1000, True, 1000),  # not a power of two: masked columns
    ("bfloat16", 33, 64, False, 96), ("float32", 2, 4096, False, 4096),
]
# Gemma's (1 + weight) norms: (dtype, rows, cols, residual, row stride)
OFFSET_NORM_CASES = [("bfloat16", 5, 1152, True, 1152), ("float32", 3, 256, False, 320)]
ROTARY_CASES = [("bfloat16", 1, 40, 64), ("float32", 7, 5, 128), ("bfloat16", 3, 12, 80)]


@pytest.mark.parametrize("dtype, rows, cols, residual, row_stride", RMS_NORM_CASES)
def test_rms_norm_kernel(interpreter, dtype, rows, cols, residual, row_stride):
    interpreter("check_rms_norm", dtype=dtype, rows=rows, cols=cols, residual=residual,
                row_stride=row_stride)


@pytest.mark.parametrize("dtype, rows, cols, residual, row_stride", OFFSET_NORM_CASES)
def test_offset_rms_norm_kernel(interpreter, dtype, rows, cols, residual, row_stride):
    interpreter("check_rms_norm", dtype=dtype, rows=rows, cols=cols, residual=residual,
                row_stride=row_stride, offset=True)


@pytest.mark.parametrize("dtype, tokens, heads, head_dim", ROTARY_CASES)
def test_rotary_kernel(interpreter, dtype, tokens, heads, head_dim):
    interpreter("check_rotary", dtype=dtype, tokens=tokens, heads=heads, head_dim=head_dim)


@pytest.mark.gpu
def test_layer_kernels_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for dtype, rows, cols, residual, stride in RMS_NORM_CASES:
        check_rms_norm(dtype, rows, cols, residual, stride, device="cuda")
    for dtype, rows, cols, residual, stride in OFFSET_NORM_CASES:
        check_rms_norm(dtype, rows, cols, residual, stride, device="cuda", offset=True)
    for dtype, tokens, heads, head_dim in ROTARY_CASES:
        check_rotary(dtype, tokens, heads, head_dim, device="cuda")


def test_eager_cpu_runs_the_torch_reference():
    x = torch.randn(4, 256)
    w = torch.rand(256)
    assert torch.equal(norm_ops.rms_norm_impl(x, w, 1e-6),
                       norm_ops.rms_norm_reference(x, w, 1e-6))
    out, summed = norm_ops.add_rms_norm_impl(x, x, w, 1e-6)
    assert torch.equal(summed, x + x)
    assert torch.equal(out, norm_ops.rms_norm_reference(x + x, w, 1e-6))


def test_ops_trace_to_triton_kernels_with_an_unbacked_token_count(monkeypatch):
    # What torch.compile does to the ops on CUDA, short of Inductor's codegen: Dynamo
    # runs their bodies on fake tensors whose token count is an unbacked symbol (a
    # branch on it fails: "could not guard on data-dependent expression"), then AOT
    # turns each into the user-kernel op Inductor launches itself, with the token count
    # as the grid. Triton compiles for sm_90 through a stand-in driver; nothing runs.
    import triton
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.decorators import mark_unbacked

    from llmfast.kernels.launch.offline_target import offline_hopper
    from llmfast.kernels.layers.kernel_choice import layer_kernels
    from llmfast.kernels.layers.triton_ops import register_triton_ops

    if torch.cuda.is_available():
        pytest.skip("the gpu tests compile the model for real")
    if not isinstance(layer_kernels().rms_norm_kernel, triton.runtime.JITFunction):
        pytest.skip("triton was imported with TRITON_INTERPRET=1")
    register_triton_ops()
    monkeypatch.setattr(norm_ops, "_kernel_takes", lambda x, w: True)  # as on CUDA
    monkeypatch.setattr(rotary_ops, "_kernel_takes", lambda x, cos_sin: True)
    graphs = []

    def trace_only(gm, example_inputs):
        graphs.append(gm)

        def run(args):
            raise _Traced

        run._boxed_call = True
        return run

    def f(x, residual, weight, positions, qk, cos_sin, sign):
        a = torch.ops.llmfast.rms_norm(x, weight, 1e-5)
        b, c = torch.ops.llmfast.add_rms_norm(x, residual, weight, 1e-5)
        return a, b, c, torch.ops.llmfast.rotary_embedding(positions, qk, cos_sin, sign)

    x, residual, qk = torch.randn(3, 64), torch.randn(3, 64), torch.randn(3, 4, 16)
    positions = torch.tensor([0, 1, 2])
    for t in (x, residual, positions, qk):
        mark_unbacked(t, 0)
    torch._dynamo.reset()
    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=trace_only), fullgraph=True)
    with offline_hopper(), pytest.raises(_Traced):
        compiled(x, residual, torch.ones(64), positions, qk, torch.randn(10, 16),
                 torch.tensor([[-1.0], [1.0]]))
    torch._dynamo.reset()
    launches = [n for n in graphs[0].graph.nodes
                if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert len(launches) == 3
    for node in launches:
        (grid,) = node.kwargs["grid"]
        assert isinstance(grid[0], torch.fx.Node) and grid[1:] == (1, 1)  # the token count
    # The outputs, and only they, are what the kernels write.
    assert [sorted(n.kwargs["tensors_to_clone"]) for n in launches] == [
        ["out_ptr"], ["out_ptr", "residual_out_ptr"], ["out_ptr"]]


class _Traced(Exception):
    pass


def test_model_import_does_not_register_the_triton_ops():
    # Registering a triton op imports torch._inductor (and Dynamo, Triton): ~1 s an
    # eager engine must not pay. The compiler registers them before tracing.
    code = ("import sys, torch, llmfast.models.decoder\n"
            "assert 'torch._dynamo' not in sys.modules and 'triton' not in sys.modules\n"
            "assert not hasattr(torch.ops.llmfast, 'rms_norm')\n"
            "from llmfast.kernels.layers.triton_ops import register_triton_ops\n"
            "register_triton_ops(); register_triton_ops()\n"
            "x = torch.randn(2, 8); w = torch.ones(8)\n"
            "out = torch.ops.llmfast.rms_norm(x, w, 1e-6)\n"
            "from llmfast.kernels.layers.rms_norm import rms_norm_reference\n"
            "assert torch.equal(out, rms_norm_reference(x, w, 1e-6))\n"
            "n, r = torch.ops.llmfast.add_rms_norm(x, x, w, 1e-6)\n"
            "assert torch.equal(r, x + x)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


if __name__ == "__main__":
    _serve(globals())
