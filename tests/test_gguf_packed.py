"""GGUF blocks kept packed on the CPU (`--quantization gguf`): each block type's decoding
and int4 planes against `gguf.quants.dequantize`, the packed matmul against a float64
reference, and a tiny GGUF model's logits against its dequantized float32 self."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmfast.kernels.cpu.int4_dequant import dequantize_packed
from llmfast.kernels.cpu.int4_linear import Int4Linear, dequantize_planes, nibble_planes
from llmfast.models.formats.gguf_blocks import PACKABLE_TYPES, decode_blocks
from tests.helpers.gguf_files import quantized_blocks, tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import train_byte_level_bpe

# The kernel rounds activations, scales, zeros and its output to bfloat16 (8 bits): each
# output may be off by 2^-7 of the sum of |x| |w| over its row, with room to spare
# (four roundings of 2^-9 each).
MATMUL_RTOL = 2.0**-7


def _blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    import gguf

    data = np.random.default_rng(seed).normal(0, 0.1, (rows, cols)).astype(np.float32)
    return quantized_blocks(data, gguf.GGMLQuantizationType[type_name], seed)


def _dequantized(raw: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float64)


@pytest.mark.parametrize("type_name", PACKABLE_TYPES)
def test_decoded_codes_and_planes_are_the_gguf_weights(type_name):
    raw = _blocks(type_name, 24, 512)
    want = _dequantized(raw, type_name)
    codes = decode_blocks(raw, type_name, 512)
    assert codes.codes.max() < 2**codes.bits
    # gguf computes in float32, we in float64: equal up to float32 rounding.
    np.testing.assert_allclose(codes.dequantize(), want, rtol=2e-7, atol=1e-7)
    values, sz, x_index = nibble_planes(codes)
    assert values.max() < 16
    np.testing.assert_allclose(dequantize_planes(values, sz, x_index, 512), want,
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", PACKABLE_TYPES)
# 70 tokens: past DEQUANTIZE_MIN_TOKENS, the dequantized float32 GEMM.
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_packed_matmul_matches_float64(type_name, num_tokens):
    rows = 40  # not a multiple of 16: padded rows, sliced off
    raw = _blocks(type_name, rows, 512, seed=num_tokens)
    weight = torch.from_numpy(_dequantized(raw, type_name))  # [N, K] float64
    bias = torch.randn(rows)
    layer = Int4Linear.from_codes(decode_blocks(raw, type_name, 512), bias)
    x = torch.randn(num_tokens, 512)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, rows)
    want = x.double() @ weight.T + bias.double()
    bound = MATMUL_RTOL * (x.double().abs() @ weight.abs().T) + 1e-6
    assert ((out.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("type_name", PACKABLE_TYPES)
def test_dequantized_kernel_layout_is_the_planes(type_name):
    """The prefill path reads the kernel's packed bytes back (dequantize_packed): the
    planes' values with the kernel's bfloat16 scales and zeros, folded onto the columns."""
    from llmfast.kernels.cpu.int4_dequant import packed_layout_known

    if not packed_layout_known():  # another torch or ISA: every call takes the kernel
        pytest.skip("this torch packs int4 weights in another layout")
    raw = _blocks(type_name, 40, 512)
    codes = decode_blocks(raw, type_name, 512)
    layer = Int4Linear.from_codes(codes)
    values, sz, x_index = nibble_planes(codes)
    want = dequantize_planes(values, torch.from_numpy(sz).bfloat16().float().numpy(),
                             x_index, 512)
    got = dequantize_packed(layer.weight_packed, layer.scales_and_zeros, layer.x_index,
                            512, 40)
    assert got.shape == (40, 512)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=0,
                               atol=1e-6 * np.abs(want).max())


def test_unknown_type_refused():
    with pytest.raises(ValueError, match="no packed CPU form for GGUF type Q2_K"):
        decode_blocks(np.zeros((1, 84), np.uint8), "Q2_K", 256)


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe()


# Hidden and intermediate sizes of 256: the K-quants' super-blocks span 256 columns.
K_SIZES = dict(hidden_size=256, intermediate_size=256, head_dim=64)
PROMPTS = [[5, 9, 14, 3, 22, 7], [30, 2, 2, 41]]
NEXT_IDS = [11, 8]


@pytest.fixture(scope="module", params=PACKABLE_TYPES)
def tiny_gguf(request, bpe, tmp_path_factory):
    import gguf

    model = tiny_llama(bpe.get_vocab_size(), tie=True, **K_SIZES)
    root = tmp_path_factory.mktemp(request.param)
    path = write_llama_gguf(root / "tiny.gguf", model, bpe,
                            gguf.GGMLQuantizationType[request.param], quant_embedding=True)
    return request.param, path


def test_tiny_model_logits_match_dequantized(tiny_gguf, tmp_path, monkeypatch):
    """Every linear packed (the tied lm_head from the embedding's blocks): logits within
    3 % of the logits' range of the float32 dequantized model's (measured: 0.3-1.7 %,
    Q8_0 the most: its two planes double the bfloat16 roundings)."""
    from llmfast.distributed import TensorParallelGroup
    from llmfast.kernels.cpu.int4_linear import Int4Linear
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.tp_runs import paged_logits

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    type_name, path = tiny_gguf
    source = resolve_model(str(path))
    assert source.gguf_path == path
    models = {q: build_model(source, torch.float32, "cpu", max_positions=128,
                             tp=TensorParallelGroup.single(), quantization=q)
              for q in (None, "none")}
    packed = models[None]
    linears = [m for m in packed.modules() if isinstance(m, torch.nn.Linear)]
    assert linears == [] and isinstance(packed.lm_head, Int4Linear)
    assert not any(isinstance(m, Int4Linear) for m in models["none"].modules())
    got, want = (torch.from_numpy(paged_logits(models[q], PROMPTS, NEXT_IDS))
                 for q in (None, "none"))
    tol = 0.03 * (want.max() - want.min())
    assert (got - want).abs().max() <= tol, type_name
    # Greedy picks a token whose reference logit is within the tolerance of the best.
    picked = want.gather(1, got.argmax(-1, keepdim=True)).squeeze(1)
    assert (picked >= want.max(-1).values - 2 * tol).all()


def test_packed_model_starts_through_the_engine(tiny_gguf, tmp_path, monkeypatch):
    """The engine starts and decodes a packed model on the CPU (its start-up reads the
    model's device without a `weight` on the packed lm_head: worker/startup/
    gemv_routing.py), its greedy tokens those of the packed model stepped by hand."""
    from llmfast import LLM, SamplingParams
    from llmfast.kernels.cpu.int4_linear import Int4Linear
    from tests.helpers.tp_runs import paged_logits

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    type_name, path = tiny_gguf
    llm = LLM(str(path), quantization="gguf", max_model_len=64)
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, Int4Linear)
    prompt = PROMPTS[0]
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    want = paged_logits(model, [prompt], [0])[len(prompt) - 1].argmax()  # its last token
    assert out.outputs[0].token_ids == [int(want)], type_name


def test_packed_weight_bytes(tiny_gguf, tmp_path, monkeypatch):
    """decode_weight_bytes counts the packed planes and scales, not the float32 copy;
    the float32 embedding is read by rows only, so it is not counted once untied."""
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from llmfast.models.weight_bytes import decode_weight_bytes

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    type_name, path = tiny_gguf
    source = resolve_model(str(path))
    packed = build_model(source, torch.float32, "cpu", max_positions=128, quantization="gguf")
    plain = build_model(source, torch.float32, "cpu", max_positions=128, quantization="none")
    linear_bytes = sum(p.numel() * p.element_size() for m in packed.modules()
                       if isinstance(m, Int4Linear) for p in m.parameters())
    others = sum(p.numel() * 4 for n, p in plain.named_parameters()
                 if "norm" in n)
    assert decode_weight_bytes(packed) == linear_bytes + others
    # Q6_K's groups of 16, padded to 32, in four planes: 2.5 bytes a weight, the rest
    # 0.6-1.3.
    share = 0.7 if type_name == "Q6_K" else 0.4
    assert decode_weight_bytes(packed) < share * decode_weight_bytes(plain)


def test_quantization_gguf_errors(tmp_path, monkeypatch):
    from llmfast.models.loading.load_error import LoadError
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    source = resolve_model("random:tiny")
    with pytest.raises(LoadError, match="--quantization gguf needs a .gguf model"):
        build_model(source, torch.float32, "cpu", quantization="gguf")
    # The default for a non-GGUF source: nothing packed.
    model = build_model(source, torch.float32, "cpu", max_positions=64)
    assert not any(isinstance(m, Int4Linear) for m in model.modules())


# The README's prompts and a few more: chat-templated, greedy.
REAL_PROMPTS = [
    "What is the capital of France?",
    "And of Italy?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "List the planets of the solar system.",
]


@pytest.mark.slow
def test_real_default_model_packed_agrees_with_dequantized():
    """The default model (its Q4_1 GGUF, the tied head Q8_0): greedy text of the packed
    model against the dequantized float32 one. The README's answer must be the same; over
    all prompts the tokens must agree up to the first divergence on most of them (a
    near-tie may flip one token, after which the texts part)."""
    from llmfast import LLM, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0)
    texts = {}
    for q in ("gguf", "none"):
        llm = LLM(quantization=q, max_model_len=256)
        conversations = [[{"role": "user", "content": p}] for p in REAL_PROMPTS]
        outs = llm.chat(conversations, params)
        texts[q] = [o.outputs[0].token_ids for o in outs]
        del llm
    assert texts["gguf"][0] == texts["none"][0]
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
              for x, y in zip(texts["gguf"], texts["none"])]
    total = sum(min(len(x), len(y)) for x, y in zip(texts["gguf"], texts["none"]))
    print(f"greedy prefix agreement {sum(common)}/{total} tokens; per prompt {common}")
    assert sum(common) >= 0.75 * total


def test_tensor_table_matches_gguf_reader(tiny_gguf):
    import gguf

    from llmfast.models.formats.gguf_tensors import read_tensor_infos

    _, path = tiny_gguf
    ours = read_tensor_infos(path)
    theirs = gguf.GGUFReader(path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name


def test_tensor_table_of_a_non_gguf_file_is_refused(tmp_path):
    from llmfast.models.formats.gguf_metadata import GGUFError
    from llmfast.models.formats.gguf_tensors import read_tensor_infos

    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all, clearly")
    with pytest.raises(GGUFError, match="x.gguf is not a GGUF file"):
        read_tensor_infos(path)


def test_packed_linear_keeps_a_bfloat16_models_dtype():
    raw = _blocks("Q4_1", 16, 256)
    layer = Int4Linear.from_codes(decode_blocks(raw, "Q4_1", 256), torch.randn(16))
    x = torch.randn(3, 256)
    out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x), rtol=2**-6, atol=2**-6 * x.abs().sum())


def test_packed_linear_traces_as_one_op():
    """Compiled graphs see the layer as `llmfast::int4_linear` (Inductor's own lowering
    of the int4 kernel fails under fake tensors): same outputs as eager, a decode-sized
    call and a prefill-sized one (the dequantizing path) through one graph."""
    raw = _blocks("Q8_0", 40, 512)  # two planes: the column index too
    layer = Int4Linear.from_codes(decode_blocks(raw, "Q8_0", 512), torch.randn(40))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)
    for num_tokens in (3, 70):
        x = torch.randn(num_tokens, 512)
        assert torch.equal(compiled(x), layer(x))
    ops = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.llmfast.int4_linear in ops  # Dynamo's graphs hold the packet
    assert not any("int4pack" in str(op) for op in ops)
