"""The skinny linear (kernels/gemv/) against a float64 oracle with a derived error bound
(tests/helpers/gemv.py): the torch form in-process, and the Triton GEMV (plain, split-K,
tl.dot at 16 rows, each fusion: RMSNorm prologue, silu(gate) * up, + residual, bias, and
fp8 weights with per-row scales) under the Triton interpreter in a child process (see
tests/test_attention_kernels.py for why a child), at shapes whose N and K are no
multiples of the tiles, for M from 1 to 16."""

from __future__ import annotations

import pytest
import torch

from llmfast.kernels.gemv.ops import skinny_linear_torch
from tests.helpers.gemv import assert_within, oracle, random_inputs, record_gemv_rows

FUSIONS = {  # name -> (skinny_linear keywords taken from random_inputs, silu_mul)
    "plain": ((), False),
    "bias": (("bias",), False),
    "norm": (("norm_weight",), False),
    "silu_mul": ((), True),
    "residual": (("residual",), False),
    "norm_silu_mul": (("norm_weight",), True),
    "norm_bias": (("norm_weight", "bias"), False),  # Qwen2's fused qkv
}


def _case(fusion: str, rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    """(inputs for skinny_linear, the oracle's (value, bound))."""
    names, silu_mul = FUSIONS[fusion]
    inputs = random_inputs(rows, n, k, dtype, seed=seed + rows, silu_mul=silu_mul)
    kwargs = {name: inputs[name] for name in names}
    if "bias" in kwargs:
        kwargs["bias"] = kwargs["bias"][:n]
    args = dict(x=inputs["x"], weight=inputs["weight"], eps=1e-5, silu_mul=silu_mul, **kwargs)
    want = oracle(inputs["x"], inputs["weight"], dtype, silu_mul=silu_mul, **kwargs)
    return args, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_torch_form_matches_float64(fusion, dtype):
    """The ops the GEMV replaces (what CPU and cuBLAS-chosen launches run) meet the same
    bound, so the bound is one a correct computation meets."""
    for rows in (1, 5, 16):
        args, want = _case(fusion, rows, 40, 72, dtype)
        assert_within(skinny_linear_torch(**args), want, dtype)


def test_bound_catches_a_missing_fusion():
    """The bound is tight enough to fail a kernel that skipped a step: the norm's
    result without the norm, silu_mul's without the silu."""
    args, want = _case("norm", 4, 40, 72, torch.bfloat16)
    with pytest.raises(AssertionError, match="past the bound"):
        assert_within(skinny_linear_torch(**{**args, "norm_weight": None}), want,
                      torch.bfloat16)
    args, want = _case("silu_mul", 4, 40, 72, torch.bfloat16)
    gate, up = skinny_linear_torch(**{**args, "silu_mul": False}).chunk(2, dim=-1)
    with pytest.raises(AssertionError, match="past the bound"):
        assert_within(gate * up, want, torch.bfloat16)


# ------------------------------------------------------------------ Triton, interpreted


@pytest.fixture(scope="module")
def interpreter():
    from tests.test_attention_kernels import interpreter_child

    yield from interpreter_child(__file__)


def check_gemv(fusion: str, rows: int, n: int, k: int, dtype: str, config: dict) -> None:
    from llmfast.kernels.gemv.launch_config import GemvConfig
    from llmfast.kernels.gemv.ops import gemv_triton

    dt = getattr(torch, dtype)
    args, want = _case(fusion, rows, n, k, dt)
    x, weight = args.pop("x"), args.pop("weight")
    assert_within(gemv_triton(x, weight, GemvConfig(**config).check(), **args), want, dt)


def check_fp8(fusion: str, rows: int, n: int, k: int, dtype: str, config: dict) -> None:
    """fp8 weights (quantized per row as `--quantization fp8` does) against the oracle
    of the same fp8 values times their scales: the rows stay in the model dtype."""
    from llmfast.kernels.fp8_linear import quantize_weight
    from llmfast.kernels.gemv.launch_config import GemvConfig
    from llmfast.kernels.gemv.ops import gemv_triton

    dt = getattr(torch, dtype)
    args, _ = _case(fusion, rows, n, k, dt)
    x, weight = args.pop("x"), args.pop("weight")
    weight_fp8, scale = quantize_weight(weight.float())  # [N, K], [1, N]
    want = oracle(x, weight_fp8, dt, weight_scale=scale,
                  **{k: v for k, v in args.items() if k != "eps"})
    got = gemv_triton(x, weight_fp8, GemvConfig(**config).check(), weight_scale=scale, **args)
    assert_within(got, want, dt)


def check_dispatch(rows: int, backend: str) -> None:
    """skinny_linear under the interpreter: up to 16 rows the Triton GEMV (the
    interpreter's config), more rows the torch form; --gemv cublas: never Triton."""
    from llmfast.kernels.gemv import ops

    with record_gemv_rows() as calls:
        args, want = _case("residual", rows, 24, 40, torch.float32)
        assert_within(ops.skinny_linear(**args, backend=backend), want, torch.float32)
    assert calls == ([rows] if rows <= 16 and backend != "cublas" else []), calls


SMALL = dict(block_n=16, block_k=32, num_warps=1, num_stages=1)
# (rows, n, k, config): partial N and K tiles everywhere; split ranges that end mid-tile
# and a split count larger than the K steps (empty ranges shrink it); tl.dot at 16 rows.
SHAPES = [
    (1, 40, 100, SMALL),
    (3, 33, 70, {**SMALL, "split_k": 2}),
    (7, 20, 130, {**SMALL, "split_k": 4}),
    (2, 24, 40, {**SMALL, "split_k": 8}),
    (16, 48, 96, {**SMALL, "dot": True}),
    (11, 20, 64, {**SMALL, "block_k": 16, "split_k": 4, "dot": True}),
]


@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"m{s[0]}-n{s[1]}-k{s[2]}")
def test_triton_gemv_matches_float64(interpreter, fusion, shape):
    rows, n, k, config = shape
    dtype = "bfloat16" if rows % 2 else "float32"  # both dtypes across the shapes
    interpreter("check_gemv", fusion=fusion, rows=rows, n=n, k=k, dtype=dtype, config=config)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("fusion", ["plain", "norm_silu_mul", "residual"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]],
                         ids=lambda s: f"m{s[0]}-n{s[1]}-k{s[2]}")
def test_triton_fp8_gemv_matches_float64(interpreter, fusion, shape, dtype):
    rows, n, k, config = shape
    interpreter("check_fp8", fusion=fusion, rows=rows, n=n, k=k, dtype=dtype, config=config)


@pytest.mark.parametrize(("rows", "backend"), [(1, "auto"), (16, "triton"), (17, "auto"),
                                               (4, "cublas")])
def test_dispatch_by_rows(interpreter, rows, backend):
    interpreter("check_dispatch", rows=rows, backend=backend)


def check_fused_decoder(dtype: str, rows: int) -> None:
    """A tiny Llama's forward with the fused layers (models/fused_layer.py) against the
    plain layers on the same batch, every kernel interpreted: `rows` decode requests
    (each a GEMV launch of `rows` rows: 4 fused launches a layer), or past 16 rows one
    prefill (the op's torch form). The KV writes are the same in both runs; the fused
    form is routed as the engine routes it (--gemv triton --gemv-fuse)."""
    from llmfast.config import SkinnyLinearConfig
    from llmfast.worker.startup.gemv_routing import route_gemv
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.static_buffers import StaticBatch

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    model = build_model(resolve_model("random:tiny"), dt, "cpu", max_positions=64)
    assert model.model.fusable
    decode = rows <= 16
    num_reqs = rows if decode else 1
    static = StaticBatch(model, num_reqs, 48, max_num_tokens=rows, block_size=16)
    for k_cache, v_cache in static.caches:
        k_cache.normal_()
        v_cache.normal_()
    context = 20
    for r in range(num_reqs):
        n = 1 if decode else rows
        lo = r if decode else 0
        pos = torch.arange(context - n, context)
        static.input_ids[lo:lo + n] = torch.randint(1, 500, (n,))
        static.positions[lo:lo + n] = pos
        blocks = static.block_table[r, pos // 16].long()
        static.slot_mapping[lo:lo + n] = blocks * 16 + pos % 16
        static.table[r].copy_(static.block_table[r])
        static.seq_lens[r] = context
    static.query_start_loc[:num_reqs + 1] = torch.arange(num_reqs + 1) * (1 if decode else rows)
    outs = {}
    with record_gemv_rows() as calls:
        for fused in (False, True):
            routing = route_gemv(model, SkinnyLinearConfig("triton", fused), range(1, 17))
            assert routing.fused == fused and model.model.gemv_fused == ("triton" if fused
                                                                         else "")
            assert routing.routed == 0  # (CPU: the plain layers keep their own paths)
            outs[fused] = static.run(model.model, rows, num_reqs,
                                     max_query_len=1 if decode else rows).double()
    assert calls == ([rows] * 4 * model.config.num_hidden_layers if decode else []), calls
    err = (outs[True] - outs[False]).abs().max().item()
    scale = outs[False].abs().max().item()
    # float32: the same sums in another order; bfloat16: the GEMV's rounding (truncated
    # under the interpreter) against torch's, two layers deep.
    assert err <= (1e-5 if dt == torch.float32 else 4e-2) * scale, (err, scale)


def check_fused_decoder_compiles() -> None:
    """The fused layers traced by Dynamo in one graph (fullgraph: the op, its
    trace-time choices, attention), token count unbacked, equal to eager. (The norms'
    triton ops take no interpreted kernels under compile: torch's ops here.)"""
    from llmfast.kernels.layers import kernel_choice
    from llmfast.kernels.layers.triton_ops import register_triton_ops
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.static_buffers import StaticBatch

    model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", max_positions=64)
    static = StaticBatch(model, 2, 48, max_num_tokens=2, block_size=16)
    for k_cache, v_cache in static.caches:
        k_cache.normal_()
        v_cache.normal_()
    pos = 10
    static.input_ids[:2] = torch.tensor([5, 7])
    static.positions[:2] = pos
    static.slot_mapping[:2] = static.block_table[:2, 0].long() * 16 + pos
    static.table[:2].copy_(static.block_table[:2])
    static.query_start_loc[:3] = torch.tensor([0, 1, 2])
    static.seq_lens[:2] = pos + 1
    saved = kernel_choice._ENABLED
    kernel_choice._ENABLED = False
    model.model.gemv_fused = "auto"  # (the interpreter's config: what routing sets)
    try:
        register_triton_ops()
        eager = static.run(model.model, 2, 2, max_query_len=1)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(model.model, backend=backend, fullgraph=True)

        def forward(ids, positions, md):
            torch._dynamo.decorators.mark_unbacked(ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
            return compiled(ids, positions, md)

        got = static.run(forward, 2, 2, max_query_len=1)
    finally:
        kernel_choice._ENABLED = saved
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("skinny_linear" in t for t in targets) == 4 * model.config.num_hidden_layers
    assert not any("rms_norm" in t or "silu" in t for t in targets[:-1])  # the final norm
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_fused_decoder_compiles(interpreter):
    interpreter("check_fused_decoder_compiles")


@pytest.mark.parametrize(("dtype", "rows"), [("float32", 3), ("bfloat16", 1),
                                             ("float32", 20)])
def test_fused_decoder_matches_plain_layers(interpreter, dtype, rows):
    interpreter("check_fused_decoder", dtype=dtype, rows=rows)


if __name__ == "__main__":  # the interpreter child (TRITON_INTERPRET=1)
    from tests.test_attention_kernels import _serve

    _serve(globals())
