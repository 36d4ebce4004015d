"""The per-step memo of the eager CPU paths (attention/cpu_step.py) against what each
layer computes on its own: the attention plan per KV-cache group, window and cache
layout (and the attention it drives against the float64 reference), the rotary rows
(against a float64 loop over the rotation's definition), the padding flag (against a
plain loop); and a whole model's step with the memo equal, bit for bit, to the step
without it, over KV-cache groups and sliding windows."""

from __future__ import annotations

import math

import pytest
import torch

from llmfast.attention import cpu as cpu_attention
from llmfast.attention.cpu_step import CpuStepState
from llmfast.attention.ops import paged_attention_reference, reshape_and_cache_reference
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.config import ModelConfig, RopeScaling
from llmfast.kernels.layers.rotary_reference import rope_rows, rotary_reference, rotate
from llmfast.models.cpu_layer import cpu_layer_forward
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.rope import rope_table
from tests.helpers.paged import MIXED_STEPS, PagedSequences
from tests.test_cpu_attention import _case


def _same_plan(a, b) -> None:
    """Two plans describe the same work (tensors equal, fields equal)."""
    assert len(a.decode) == len(b.decode) and len(a.prefill) == len(b.prefill)
    assert a.max_gather_blocks == b.max_gather_blocks
    for x, y in zip(a.decode, b.decode):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.blocks, y.blocks)
        assert (x.mask is None) == (y.mask is None)
        assert x.mask is None or torch.equal(x.mask, y.mask)
        assert (x.num_blocks, x.first_token, x.keys) == (y.num_blocks, y.first_token, y.keys)
    for x, y in zip(a.prefill, b.prefill):
        assert (x.q_start, x.q_end, x.num_keys) == (y.q_start, y.q_end, y.num_keys)
        assert torch.equal(x.blocks, y.blocks) and torch.equal(x.mask, y.mask)


@pytest.mark.parametrize("q_lens, ctx", [([1], [37]), ([1, 5, 1, 0, 9, 1], [17, 40, 40, 12, 30, 1]),
                                          ([1, 1, 1], [9, 33, 20])])
def test_step_plan_per_group_and_window_equals_each_layers(q_lens, ctx):
    """Two groups (block tables) x windows (None, 8) x two cache layouts: the memo's
    plan equals the one a layer looks up alone, is built once per (group, window,
    layout) and shared by the layers asking again, and drives attention equal to the
    float64 reference with the same window (stale slots poisoned)."""
    cases = [_case(seed, q_lens, ctx, num_heads=8, num_kv=num_kv, hd=hd)
             for seed, (num_kv, hd) in enumerate([(2, 16), (4, 8)])]
    _, _, _, table_b, *_ = _case(9, q_lens, ctx)  # the second group's table
    owner = AttentionWorkspaces(c[1] for c in cases)
    step = CpuStepState()
    seen = {}
    for _ in range(2):  # a second layer of each kind asks again
        for q, kc, vc, table_a, qsl, seq_lens, total in cases:
            for table in (table_a, table_b):
                for window in (None, 8):
                    plan = step.plan(kc, table, qsl, seq_lens, window)
                    key = (id(table), window, tuple(kc.shape[1:]))
                    assert seen.setdefault(key, plan) is plan
                    _same_plan(plan, cpu_attention._build_plan(*cpu_attention.plan_key(
                        kc, table, qsl, seq_lens, window)))
                    expected = torch.empty(q.shape, dtype=torch.float64)
                    paged_attention_reference(q.double(), kc.double(), vc.double(), table,
                                              qsl, seq_lens, 0.3, expected,
                                              compute_dtype=torch.float64, window=window)
                    out = torch.full_like(q, float("nan"))
                    cpu_attention.paged_attention_cpu(q, kc, vc, table, qsl, seq_lens, 0.3,
                                                      out, window, plan)
                    torch.testing.assert_close(out[:total].double(), expected[:total],
                                               atol=1e-5, rtol=1e-5)
    assert len(seen) == 2 * 2 * 2  # layouts x groups x windows
    assert owner.num_plans >= 1


def test_one_row_decode_slices_its_visible_keys():
    """Batch 1 decode: no mask, the visible keys a slice (the whole context, or the
    window's end of it), its row read in place; stale slots past the context and blocks
    before the window are poisoned and must not leak in."""
    q, kc, vc, table, qsl, seq_lens, total = _case(11, [1], [45], block_size=8)
    for window in (None, 10):
        plan = cpu_attention._build_plan(*cpu_attention.plan_key(kc, table, qsl, seq_lens,
                                                                 window))
        (chunk,) = plan.decode
        assert chunk.mask is None and chunk.first_token == 0
        first_block = 0 if window is None else (45 - window) // 8
        assert chunk.keys == slice(0 if window is None else 45 - window - 8 * first_block,
                                   45 - 8 * first_block)
    poisoned = kc.clone(), vc.clone()
    for pos in range(45, table.shape[1] * 8):  # past the context
        poisoned[0][table[0, pos // 8], pos % 8] = 1e4
        poisoned[1][table[0, pos // 8], pos % 8] = -1e4
    for window in (None, 10):
        expected = torch.empty(q.shape, dtype=torch.float64)
        paged_attention_reference(q.double(), kc.double(), vc.double(), table, qsl, seq_lens,
                                  0.25, expected, compute_dtype=torch.float64, window=window)
        out = torch.full_like(q, float("nan"))
        cpu_attention.paged_attention_cpu(q, *poisoned, table, qsl, seq_lens, 0.25, out,
                                          window)
        torch.testing.assert_close(out[:1].double(), expected[:1], atol=1e-5, rtol=1e-5)


def test_rope_rows_rotate_as_the_definition():
    """The memo's rows (one lookup per table and step) rotate as rotary_reference and
    as a float64 loop over [x1 cos - x2 sin, x2 cos + x1 sin]."""
    head_dim, heads = 8, 3
    cos_sin = rope_table(head_dim, 64, 1e4, RopeScaling())
    sign = torch.tensor([[-1.0], [1.0]])
    positions = torch.tensor([5, 0, 63, 17])
    x = torch.randn(4, heads, head_dim, generator=torch.Generator().manual_seed(0))
    step = CpuStepState()
    rows = step.rope(positions, cos_sin, sign)
    assert step.rope(positions, cos_sin, sign) is rows  # the next layer's lookup
    got = rotate(x, *rows)
    assert torch.equal(got, rotary_reference(positions, x, cos_sin, sign))
    assert torch.equal(got, rotate(x, *rope_rows(positions, cos_sin, sign)))
    half = head_dim // 2
    expected = torch.empty(x.shape, dtype=torch.float64)
    for t, pos in enumerate(positions.tolist()):
        for h in range(heads):
            for i in range(half):
                angle = pos / (1e4 ** (2 * i / head_dim))
                c, s = math.cos(angle), math.sin(angle)
                x1, x2 = float(x[t, h, i]), float(x[t, h, i + half])
                expected[t, h, i] = x1 * c - x2 * s
                expected[t, h, i + half] = x2 * c + x1 * s
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # Another table (a model's local RoPE) gets rows of its own.
    other = cos_sin * 0.5
    assert not torch.equal(step.rope(positions, other, sign)[0], rows[0])


@pytest.mark.parametrize("slots", [[4, 9, 2], [4, -1, 2, -1], [-1]])
def test_padding_flag_and_cache_write(slots):
    """The flag equals a loop's answer; a write told the flag equals one that looks."""
    slot_mapping = torch.tensor(slots)
    step = CpuStepState()
    assert step.has_padding(slot_mapping) == any(s < 0 for s in slots)
    k = torch.randn(len(slots), 2, 4)
    v = torch.randn(len(slots), 2, 4)
    caches = [torch.zeros(3, 4, 2, 4) for _ in range(4)]
    reshape_and_cache_reference(k, v, caches[0], caches[1], slot_mapping)
    reshape_and_cache_reference(k, v, caches[2], caches[3], slot_mapping,
                                step.has_padding(slot_mapping))
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    for i, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(caches[2].view(-1, 2, 4)[s], k[i])


FAMILIES = {
    # sliding and global layers: two KV-cache groups
    "llama, sliding": dict(sliding_window=6,
                           layer_types=("sliding_attention", "full_attention") * 2),
    "qwen3: q/k norms, qkv biases, a sparse MLP": dict(
        qk_norm=True, qkv_bias=True, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16),
    "gemma-like: GeGLU, offset norms, o bias": dict(
        hidden_act="gelu_pytorch_tanh", norm_offset=True, o_bias=True),
}


def _model(**options) -> DecoderForCausalLM:
    config = ModelConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64,
                         vocab_size=96, **options)
    torch.manual_seed(0)
    model = DecoderForCausalLM(config, max_positions=128)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_step_with_the_memo_equals_without(family):
    """Decodes, chunks and new prompts (MIXED_STEPS): the eager CPU layers with a memo
    per step (models/cpu_layer.py) give the same logits, bit for bit, as the
    modules' forwards without one."""
    model = _model(**FAMILIES[family])
    assert model.model.cpu_layers
    if "sliding" in family:
        assert model.kv_groups.num_groups > 1
    plain = PagedSequences(model, num_seqs=4, max_len=64, block_size=4)
    memo = PagedSequences(model, num_seqs=4, max_len=64, block_size=4, cpu_step=True)
    calls = []
    from llmfast.models import decoder

    def counted(layer, *args):
        calls.append(layer)
        return cpu_layer_forward(layer, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder, "cpu_layer_forward", counted)
        for chunks in MIXED_STEPS:
            assert torch.equal(memo.step(chunks), plain.step(chunks))
    assert len(calls) == len(MIXED_STEPS) * 4  # the memo's steps took the CPU layers


def test_packed_model_step_with_the_memo_equals_without(tmp_path, monkeypatch):
    """A GGUF model whose projections are packed (Int4Linear, Q4_1; the tied head Q8_0
    through a column index): the CPU layers, which leave the packed o_proj's and
    down_proj's bfloat16 results for the residual add to widen, give the same logits,
    bit for bit, as the modules' forwards."""
    import gguf

    from llmfast.kernels.cpu.int4_linear import Int4Linear
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.gguf_files import tiny_llama, write_llama_gguf
    from tests.helpers.tokenizers import train_byte_level_bpe

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path / "cache"))
    bpe = train_byte_level_bpe()
    path = write_llama_gguf(tmp_path / "tiny.gguf",
                            tiny_llama(bpe.get_vocab_size(), tie=True, hidden_size=256,
                                       intermediate_size=256, head_dim=64),
                            bpe, gguf.GGMLQuantizationType.Q4_1, quant_embedding=True)
    model = build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=128,
                        quantization="gguf")
    layer = model.model.layers[0]
    assert type(layer.self_attn.o_proj) is Int4Linear and layer.self_attn.o_proj.plain
    assert type(layer.mlp.down_proj) is Int4Linear
    plain = PagedSequences(model, num_seqs=4, max_len=64, block_size=4)
    memo = PagedSequences(model, num_seqs=4, max_len=64, block_size=4, cpu_step=True)
    for chunks in MIXED_STEPS:
        assert torch.equal(memo.step(chunks), plain.step(chunks))
