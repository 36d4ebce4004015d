"""The CPU row-split linear against a float64 oracle, and its custom op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmfast.kernels.cpu.linear import (
    MAX_SPLIT_TOKENS,
    MAX_SPLIT_TOKENS_LM_HEAD,
    Linear,
    cpu_linear,
    num_row_blocks,
    prepack_linears,
    prepack_supported,
    row_split_linear,
)


def test_num_row_blocks_divides_rows():
    assert num_row_blocks(576) == 8
    assert num_row_blocks(49152) == 8
    assert num_row_blocks(6) == 6
    assert num_row_blocks(15) == 5
    assert num_row_blocks(7) == 7
    assert num_row_blocks(11) == 1  # prime above the cap: no split
    assert num_row_blocks(1) == 1


def test_worked_example_column_order():
    # N = 6 rows, 3 blocks: column n of the result must be weight row n.
    weight = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    x = torch.eye(4)[:2]  # picks columns 0 and 1 of the weight
    out = row_split_linear(x, weight, blocks=3)
    assert torch.equal(out, weight[:, :2].t())
    assert out.is_contiguous()


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 33, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (40, 72), (576, 48)])
def test_row_split_matches_float64(num_tokens, out_features, in_features):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    x = torch.randn(num_tokens, in_features, generator=gen)
    expected = x.double() @ weight.double().t()
    out = row_split_linear(x, weight, num_row_blocks(out_features))
    assert out.shape == (num_tokens, out_features) and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 5, MAX_SPLIT_TOKENS + 1])
def test_linear_module_equals_nn_linear(num_tokens):
    torch.manual_seed(num_tokens)
    ours = Linear(48, 80, bias=True)
    ref = nn.Linear(48, 80, bias=True)
    ref.load_state_dict(ours.state_dict())  # same parameter names
    x = torch.randn(num_tokens, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_non_contiguous_weight_falls_back():
    layer = Linear(16, 32)
    with torch.no_grad():
        layer.weight = nn.Parameter(torch.randn(16, 32).t(), requires_grad=False)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_custom_op_passes_opcheck():
    weight = torch.randn(64, 32)
    for num_tokens in (1, 4, MAX_SPLIT_TOKENS + 3):
        x = torch.randn(num_tokens, 32)
        torch.library.opcheck(cpu_linear, (x, weight, 8, MAX_SPLIT_TOKENS))
        out = torch.ops.llmfast.cpu_linear(x, weight, 8, MAX_SPLIT_TOKENS)
        torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_lm_head_splits_further():
    torch.manual_seed(1)
    head = Linear(32, 64, max_split_tokens=MAX_SPLIT_TOKENS_LM_HEAD)
    x = torch.randn(MAX_SPLIT_TOKENS_LM_HEAD, 32)
    with torch.no_grad():
        torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-5, atol=1e-5)


def test_compiled_linear_serves_every_token_count():
    torch.manual_seed(0)
    layer = Linear(32, 64)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for num_tokens in (2, 7, MAX_SPLIT_TOKENS + 5):
            x = torch.randn(num_tokens, 32)
            torch.testing.assert_close(compiled(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


needs_onednn = pytest.mark.skipif(
    not prepack_supported(torch.empty(1)), reason="this torch build has no oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 100, 300])
def test_prepacked_linear_matches_float64(num_tokens):
    torch.manual_seed(num_tokens)
    layer = Linear(96, 160, bias=True)
    assert layer.prepack() and layer.packed_weight is not None
    x = torch.randn(num_tokens, 96)
    expected = x.double() @ layer.weight.double().t() + layer.bias.double()
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (num_tokens, 160)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5)


@needs_onednn
def test_prepack_linears_budget_and_tied_weights():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.proj = Linear(32, 48)
            self.head = Linear(32, 64)
            self.head.weight = self.embed.weight  # tied, as SmolLM2's lm_head

    model = Tiny()
    weight_bytes = (48 * 32 + 64 * 32) * 4  # the tied storage counted once
    assert prepack_linears(model, max_bytes=weight_bytes - 1) == 0
    assert model.proj.packed_weight is None and model.head.packed_weight is None
    assert prepack_linears(model, max_bytes=weight_bytes) == weight_bytes
    assert model.proj.packed_weight is not None and model.head.packed_weight is not None
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.head(x), F.linear(x, model.embed.weight),
                                   rtol=1e-5, atol=2e-5)


def test_prepack_skips_other_dtypes():
    layer = Linear(16, 32).to(torch.bfloat16)
    assert not layer.prepack() and layer.packed_weight is None
