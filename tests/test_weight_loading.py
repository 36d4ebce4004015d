"""Weights made where they are used: random presets filled in place on the target device
in the target dtype (reproducible per seed and device, no float32 or second copy), and
safetensors checkpoints streamed tensor by tensor with the same result as reading the
whole file and fusing it by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from llmfast.models.formats.safetensors_reader import (
    SafetensorsFile,
    SafetensorsFormatError,
    TensorReader,
)
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import resolve_model
from llmfast.models.loading.random_weights import RANDOM_WEIGHT_STD
from llmfast.models.weight_bytes import weight_bytes
from tests.helpers.checkpoints import make_hf_checkpoint

MAX_POSITIONS = 64  # keeps the RoPE table (fp32, made at build) far below any weight


def _random(preset: str = "tiny", dtype=torch.float32, seed: int = 0, progress=None,
            max_positions: int = MAX_POSITIONS):
    return build_model(resolve_model(f"random:{preset}"), dtype, "cpu",
                       max_positions=max_positions, seed=seed, progress=progress)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_init_reproducible_right_dtype_and_scale(dtype):
    a, b, other = _random(dtype=dtype), _random(dtype=dtype), _random(dtype=dtype, seed=1)
    params_a = dict(a.named_parameters())
    params_b = dict(b.named_parameters())
    params_other = dict(other.named_parameters())
    assert a.lm_head.weight is not a.model.embed_tokens.weight  # tiny is untied
    for name, p in params_a.items():
        assert p.dtype == dtype and p.device.type == "cpu", name
        assert torch.equal(p, params_b[name]), f"{name} differs between two seed-0 builds"
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert not torch.equal(p, params_other[name]), f"{name} ignores the seed"
            std = p.float().std().item()
            assert 0.8 * RANDOM_WEIGHT_STD < std < 1.2 * RANDOM_WEIGHT_STD, (name, std)
            assert abs(p.float().mean().item()) < 0.2 * RANDOM_WEIGHT_STD, name
    # Distinct parameters get distinct draws (one generator runs through them all).
    assert not torch.equal(params_a["model.layers.0.self_attn.o_proj.weight"],
                           params_a["model.layers.1.self_attn.o_proj.weight"])


def test_random_init_tied_head_shares_the_embedding():
    model = _random("smollm2-135m", dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


class _Allocations(TorchDispatchMode):
    """Every real (non-meta) tensor an op creates: (op, dtype, bytes). An in-place op
    or a view returns storage it was given, which is not an allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in _tensors((args, kwargs))
                 if t.device.type != "meta"}
        given_ptrs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))
                      if t.device.type != "meta"}
        for t in _tensors(out):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if id(storage) in given or storage.data_ptr() in given_ptrs:
                continue
            self.made.append((str(func), t.dtype, storage.nbytes()))
        return out


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


def test_random_init_allocates_each_parameter_once_in_its_dtype():
    """bfloat16 weights: no float32 tensor of a weight's size is ever made, and all that is
    allocated is the parameters (once) plus the small RoPE table and its temporaries."""
    with _Allocations() as seen:
        model = _random(dtype=torch.bfloat16, max_positions=16)
    params = list(model.parameters())
    smallest_weight = min(p.numel() * 2 for p in params if p.dim() == 2)
    rope_bytes = model.model.layers[0].self_attn.rotary.cos_sin.nbytes
    assert rope_bytes * 4 < smallest_weight  # so the thresholds below can tell them apart
    big = [(op, dtype, n) for op, dtype, n in seen.made if n >= smallest_weight]
    assert all(dtype == torch.bfloat16 for _, dtype, _ in big), big
    assert sorted(n for _, _, n in big) == sorted(
        p.numel() * 2 for p in params if p.numel() * 2 >= smallest_weight)
    total = sum(n for _, _, n in seen.made)
    assert total <= weight_bytes(model) + 8 * rope_bytes, (total, weight_bytes(model))


def test_progress_reports_bytes_and_rate():
    calls = []
    model = _random(progress=lambda stage, fraction: calls.append((stage, fraction)))
    assert calls, "no progress reported"
    stage, fraction = calls[-1]
    assert fraction == 1.0
    total_gb = weight_bytes(model) / 1e9
    assert stage.startswith("initialising random weights")
    assert f"{total_gb:.2f}/{total_gb:.2f} GB at " in stage and stage.endswith("GB/s")


# ---------------------------------------------------------------------- checkpoints


def _reference_load(path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The whole checkpoint read into memory and fused by hand: q/k/v rows stacked into
    qkv_proj, gate/up into gate_up_proj, then cast."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state |= load_file(file)
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                          "gate_proj.weight", "up_proj.weight")):
            continue
        fused[name] = tensor
    layers = {n.split(".")[2] for n in state if n.startswith("model.layers.")}
    for i in layers:
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        fused[attn + "qkv_proj.weight"] = torch.cat(
            [state[attn + f"{x}_proj.weight"] for x in "qkv"])
        fused[mlp + "gate_up_proj.weight"] = torch.cat(
            [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]])
    return {k: v.to(dtype) for k, v in fused.items()}


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("stored,dtype", [(torch.float32, torch.float32),
                                          (torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
def test_streaming_load_equals_whole_file_load(tmp_path, sharded, stored, dtype):
    path = make_hf_checkpoint(tmp_path / "ckpt", sharded=sharded)
    if stored != torch.float32:  # rewrite every file in the stored dtype
        for file in path.glob("*.safetensors"):
            save_file({k: v.to(stored) for k, v in load_file(file).items()}, file,
                      metadata={"format": "pt"})
    expected = _reference_load(path, dtype)
    calls = []
    model = build_model(resolve_model(str(path)), dtype, "cpu", max_positions=64,
                        progress=lambda stage, fraction: calls.append((stage, fraction)))
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, p in params.items():
        assert p.dtype == dtype
        assert torch.equal(p, expected[name]), name
    assert calls[-1][1] == 1.0 and calls[-1][0].startswith("loading weights")


# ---------------------------------------------------------------------- the reader


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dest_dtype", [None, torch.float32, torch.bfloat16])
def test_reader_matches_safetensors_own_loader(tmp_path, staged, dest_dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=gen),
        "b": torch.randn(3, 11, generator=gen).to(torch.bfloat16),
        "c": torch.randn(64, generator=gen).to(torch.float16),
        "d": torch.randn(1, generator=gen),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    file = SafetensorsFile.open(path)
    assert file.data_bytes == sum(t.nbytes for t in tensors.values())
    expected = load_file(path)
    # 48-byte chunks: every tensor but "d" crosses at least one chunk boundary when staged.
    reader = TensorReader(torch.device("cpu"), chunk_bytes=48, staged=staged)
    fd = os.open(path, os.O_RDONLY)
    try:
        with reader:
            for name, entry in file.entries.items():
                assert entry.dtype == expected[name].dtype and entry.shape == expected[name].shape
                dest = torch.full(entry.shape, float("nan"), dtype=dest_dtype or entry.dtype)
                reader.read(fd, entry, dest)
                assert torch.equal(dest, expected[name].to(dest.dtype)), name
    finally:
        os.close(fd)


@pytest.mark.parametrize("header, data, fragment", [
    (None, b"", "shorter than"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "past the end"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "do not match"),
    ({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2,
     "unsupported dtype"),
    ({"x": {"dtype": "F32"}}, b"", "malformed"),
    ([1, 2], b"", "not a JSON object"),
])
def test_reader_rejects_bad_headers(tmp_path, header, data, fragment):
    path = tmp_path / "bad.safetensors"
    if header is None:
        path.write_bytes(b"\1\2\3")
    else:
        _write_raw(path, header, data)
    with pytest.raises(SafetensorsFormatError, match=fragment):
        SafetensorsFile.open(path)


def test_reader_rejects_a_header_longer_than_the_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(SafetensorsFormatError, match="exceeds the file"):
        SafetensorsFile.open(path)


# ---------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_random_init_on_cuda_allocates_only_the_weights():
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    source = resolve_model("random:smollm2-135m")
    model = build_model(source, torch.bfloat16, device, max_positions=2048)
    peak = torch.cuda.max_memory_allocated(device) - before
    rope = model.model.layers[0].self_attn.rotary.cos_sin.nbytes
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16
               for p in model.parameters())
    # The weights once, the RoPE table and its temporaries: no float32 copy of a weight.
    assert peak <= weight_bytes(model) + 8 * rope + (8 << 20), (peak, weight_bytes(model))
    again = build_model(source, torch.bfloat16, device, max_positions=2048)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streaming_load_onto_cuda_equals_whole_file_load(tmp_path, dtype):
    path = make_hf_checkpoint(tmp_path / "ckpt", sharded=True)
    expected = _reference_load(path, dtype)
    model = build_model(resolve_model(str(path)), dtype, "cuda", max_positions=64)
    for name, p in model.named_parameters():
        assert p.device.type == "cuda" and p.dtype == dtype
        assert torch.equal(p.cpu(), expected[name]), name


@pytest.mark.gpu
def test_staged_reader_onto_cuda_with_small_chunks(tmp_path):
    gen = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(300, 7, generator=gen).to(torch.bfloat16),
               "v": torch.randn(1000, generator=gen)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    file = SafetensorsFile.open(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with TensorReader(torch.device("cuda"), chunk_bytes=256) as reader:
            dests = {n: torch.empty(e.shape, dtype=torch.float32, device="cuda")
                     for n, e in file.entries.items()}
            for name, entry in file.entries.items():
                reader.read(fd, entry, dests[name])
    finally:
        os.close(fd)
    for name, t in tensors.items():
        assert torch.equal(dests[name].cpu(), t.float()), name


def test_building_a_model_imports_no_dynamo():
    """build_model's meta-device check model used to compute the RoPE table with torch's
    Python meta kernels, the first of which imports torch._dynamo (1-6 s); an eager
    engine never needs it. A fresh process, so that nothing imported it before."""
    code = ("import sys, torch\n"
            "from llmfast.models.loading.loader import build_model\n"
            "from llmfast.models.sources.model_source import resolve_model\n"
            "build_model(resolve_model('random:tiny'), torch.float32, 'cpu',"
            " max_positions=64)\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.returncode == 0, result.stderr


def test_rope_table_on_meta_has_the_real_shape_and_on_cpu_the_values():
    from llmfast.models.rope import RotaryEmbedding, rope_table

    source = resolve_model("random:tiny")
    cfg = source.config
    head_dim = cfg.head_dim
    with torch.device("meta"):
        meta = RotaryEmbedding(head_dim, 32, cfg.rope_theta, cfg.rope_scaling)
    real = RotaryEmbedding(head_dim, 32, cfg.rope_theta, cfg.rope_scaling)
    assert meta.cos_sin.is_meta
    assert (meta.cos_sin.shape, meta.cos_sin.dtype) == (real.cos_sin.shape, real.cos_sin.dtype)
    # The oracle: cos and sin of position * frequency, written out.
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64)
                                         / head_dim))
    angles = torch.arange(32, dtype=torch.float64)[:, None] * inv_freq[None, :]
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1)
    assert cfg.rope_scaling.rope_type == "default"
    torch.testing.assert_close(real.cos_sin.double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(real.cos_sin, rope_table(head_dim, 32, cfg.rope_theta,
                                                        cfg.rope_scaling))
