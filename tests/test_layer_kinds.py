"""The per-layer-kind table of a decode step (llmfast/bench/kernels/layer_kinds.py): bytes per
kind at Llama-3.2-1B's real shapes (a meta-device model) against the arithmetic done by
hand, fp8 projections, kernel-name classification on the names an H100 profile showed
(profiles/h100-2026-11-27/call1-full_B1_kernels.md), and the table's fractions."""

from __future__ import annotations

import pytest
import torch

from llmfast.bench.kernels import layer_kinds
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.sources.model_source import resolve_model


@pytest.fixture(scope="module")
def llama_1b():
    config = resolve_model("random:llama-3.2-1b").config
    with torch.device("meta"):
        return DecoderForCausalLM(config, max_positions=256).to(torch.bfloat16)


def test_linear_kind_by_module_name():
    assert layer_kinds.linear_kind("model.layers.3.self_attn.qkv_proj") == "qkv"
    assert layer_kinds.linear_kind("model.layers.0.mlp.down_proj") == "down"
    assert layer_kinds.linear_kind("lm_head") == "lm_head"
    assert layer_kinds.linear_kind("model.layers.0.mlp.gate") is None
    assert layer_kinds.linear_kind("model.norm") is None


def test_bytes_per_kind_at_llama_1b_shapes(llama_1b):
    """Batch 1, context 128, bf16: each kind's weights and activation rows, by hand."""
    shape = layer_kinds.step_shape(llama_1b, batch=1, context=128)
    got = layer_kinds.kind_bytes(llama_1b, shape)
    layers, hidden, inter, vocab, bf16 = 16, 2048, 8192, 128256, 2
    qkv_n = 32 * 64 + 2 * 8 * 64
    assert got["qkv"] == layers * (qkv_n * hidden + hidden + qkv_n) * bf16
    assert got["o"] == layers * (hidden * 2048 + 2048 + hidden) * bf16
    assert got["gate_up"] == layers * (2 * inter * hidden + hidden + 2 * inter) * bf16
    assert got["down"] == layers * (hidden * inter + inter + hidden) * bf16
    # Tied: the embedding's weight read whole as the head.
    assert got["lm_head"] == (vocab * hidden + hidden + vocab) * bf16
    # 128 tokens of K and V in 8 KV heads of 64, plus the query and output rows.
    assert got["attention"] == layers * (128 * 2 * 8 * 64 * bf16 + 2 * 32 * 64 * bf16)
    weights = sum(got[k] for k in layer_kinds.LINEAR_KINDS)
    assert 2.47e9 < weights < 2.48e9  # the 2.47 GB of weights
    assert 0 < got["other"] < 2e6  # norms, SiLU-and-mul, embedding rows: small
    # An fp8 KV cache halves the context's bytes; 4 rows at 256 tokens: 8x them.
    fp8_kv = layer_kinds.step_shape(llama_1b, 1, 128, kv_dtype=torch.float8_e4m3fn)
    assert layer_kinds.kind_bytes(llama_1b, fp8_kv)["attention"] == \
        layers * (128 * 2 * 8 * 64 + 2 * 32 * 64 * bf16)
    wide = layer_kinds.kind_bytes(llama_1b, layer_kinds.step_shape(llama_1b, 4, 256))
    assert wide["attention"] == layers * 4 * (256 * 2 * 8 * 64 * bf16 + 2 * 32 * 64 * bf16)


def test_fp8_projections_count_their_stored_bytes():
    """After --quantization fp8, a projection streams its fp8 weight and its float32
    scales: about half its bf16 bytes; the lm_head is untouched."""
    from llmfast.models.loading.loader import build_model
    from llmfast.models.quantization.fp8 import quantize_fp8

    source = resolve_model("random:tiny")
    model = build_model(source, torch.bfloat16, "cpu", max_positions=64)
    shape = layer_kinds.step_shape(model, 1, 16)
    before = layer_kinds.kind_bytes(model, shape)
    quantize_fp8(model)
    after = layer_kinds.kind_bytes(model, shape)
    cfg = source.config
    n, k = cfg.hidden_size, cfg.intermediate_size
    acts = (k + n) * 2 * cfg.num_hidden_layers
    assert after["down"] == cfg.num_hidden_layers * (n * k + 4 * n) + acts
    assert after["down"] < 0.6 * before["down"]
    assert after["lm_head"] == before["lm_head"]


@pytest.mark.parametrize(("name", "kind"), [
    ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "linear"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "linear"),
    ("gemv_kernel", "linear"),
    ("gemv_reduce_kernel", "linear"),
    ("_decode_rope_attention_kernel", "attention"),
    ("_unified_attention_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),
    ("_rope_and_cache_kernel", "attention"),
    ("rms_norm_kernel", "other"),
    ("triton_poi_fused_mul_silu_split_0", "other"),
    ("triton_poi_fused_embedding_0", "other"),
    ("Memset (Unknown)", "other"),
])
def test_kernel_classification(name, kind):
    assert layer_kinds.classify_kernel(name) == kind


def test_profile_kinds_sums_per_kind():
    got = layer_kinds.profile_kinds({"nvjet_x": 400.0, "gemv_kernel": 10.0,
                                     "_decode_rope_attention_kernel": 81.2,
                                     "rms_norm_kernel": 64.3, "triton_poi_fused_mul_silu": 18.1})
    assert got == pytest.approx({"linear": 410.0, "attention": 81.2, "other": 82.4})


def test_table_fractions():
    """% of HBM = the bytes' time at the peak over the measured time; the step row sums
    the bytes; a kind not measured keeps its bytes and limit only."""
    peak = 3.35e12
    rows = layer_kinds.table({"qkv": 335_000_000, "attention": 3_350_000}, {"qkv": 200.0},
                             step_us=400.0, peak_bytes_per_s=peak)
    by_kind = {r["kind"]: r for r in rows}
    assert [r["kind"] for r in rows] == [*layer_kinds.KINDS, "step"]
    qkv = by_kind["qkv"]
    assert qkv["hbm_limit_us"] == pytest.approx(100.0)
    assert qkv["hbm_fraction"] == pytest.approx(0.5)
    assert qkv["gb_per_s"] == pytest.approx(1675.0)
    assert qkv["step_share"] == pytest.approx(0.5)
    attention = by_kind["attention"]
    assert attention["us"] is None and attention["hbm_fraction"] is None
    assert attention["hbm_limit_us"] == pytest.approx(1.0)
    assert by_kind["step"]["bytes"] == 338_350_000
    assert by_kind["step"]["hbm_fraction"] == pytest.approx(101.0 / 400.0)
    text = layer_kinds.markdown(rows, "t")
    assert "| qkv | 335.00 | 200.0 | 1675 | 100.0 | 50 | 50 |" in text
    no_peak = layer_kinds.table({"qkv": 1000}, {"qkv": 1.0}, None, None)
    assert no_peak[0]["hbm_fraction"] is None and no_peak[0]["gb_per_s"] == 1.0
