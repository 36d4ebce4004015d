"""Tensor parallelism on CPU (gloo): TP=2 computes what TP=1 computes.

Spawned pairs of ranks (`tests/helpers/ranks.py`) run the model and the real
`ModelRunner` driven as the executor drives it; TP=1 in this process is the oracle
(logits to float32 rounding, greedy tokens identical). Loading is checked without a
process group: a rank's model is built and filled by itself, and each parameter must
be the slice of the TP=1 parameter that an independent reading of the Megatron split
(`expected_shard` below, written from the head and column ranges, not from
llmfast/models/sharding.py) says.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from llmfast.config import ConfigError
from llmfast.distributed import TensorParallelGroup
from llmfast.models.loading.checkpoint_weights import load_safetensors_weights
from llmfast.models.loading.load_error import LoadError
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import ModelSource, resolve_model
from llmfast.kernels.cpu.linear import Linear
from llmfast.models.quantization.fp8 import Fp8Linear, quantize_fp8
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.ranks import run_ranks
from tests.helpers.tp_runs import (
    assert_ranks_match_tp1,
    model_logits,
    paged_logits,
    run_cases,
    runner_tokens,
)
from tests.helpers.engine_config import engine_config

SINGLE = TensorParallelGroup.single()
PROMPTS = [list(range(5, 75)), [20, 21, 22], [7, 9, 11, 13, 15, 17]]  # 70: two chunks
NEXT_IDS = [3, 4, 5]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        # q/k/v and o biases; 251 rows split 126 + 125 (one padding row on rank 1).
        "llama": make_hf_checkpoint(root / "llama", family="llama", attention_bias=True,
                                    vocab_size=251),
        # One KV head for two ranks (replicated); qkv biases; tied embeddings.
        "qwen2": make_hf_checkpoint(root / "qwen2", family="qwen2", num_key_value_heads=1,
                                    tie=True),
        # Per-head q/k norms.
        "qwen3": make_hf_checkpoint(root / "qwen3", family="qwen3"),
    }


# ----------------------------------------------------------------- the oracle of the split


def expected_shard(name: str, full: torch.Tensor, cfg, rank: int, world: int) -> torch.Tensor:
    """This rank's part of TP=1's parameter `name`, from the split's definition."""
    d, heads, kv, inter = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    q_heads = range(rank * heads // world, (rank + 1) * heads // world)
    # The KV heads those query heads read (one, replicated, if there are fewer than ranks).
    kv_heads = sorted({h * kv // heads for h in q_heads})
    if ".qkv_proj." in name:
        q_rows = [h * d + i for h in q_heads for i in range(d)]
        k_rows = [heads * d + h * d + i for h in kv_heads for i in range(d)]
        v_rows = [(heads + kv) * d + h * d + i for h in kv_heads for i in range(d)]
        return full[q_rows + k_rows + v_rows]
    if ".gate_up_proj." in name:
        cols = range(rank * inter // world, (rank + 1) * inter // world)
        return full[[*cols, *(inter + c for c in cols)]]
    if name.endswith("o_proj.weight"):
        return full[:, [h * d + i for h in q_heads for i in range(d)]]
    if name.endswith("down_proj.weight"):
        return full[:, rank * inter // world:(rank + 1) * inter // world]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per_rank = -(-cfg.vocab_size // world)
        rows = full[rank * per_rank:(rank + 1) * per_rank]
        return torch.cat([rows, rows.new_zeros(per_rank - len(rows), rows.shape[1])])
    return full  # norms, o_proj's bias on rank 0


def check_shards(full_model, world: int, build_rank) -> None:
    full = dict(full_model.named_parameters())
    for rank in range(world):
        model = build_rank(TensorParallelGroup(rank=rank, world_size=world))
        params = dict(model.named_parameters())
        for name, param in params.items():
            want = expected_shard(name, full[name], full_model.config, rank, world)
            assert param.shape == want.shape, (rank, name)
            torch.testing.assert_close(param, want, rtol=0, atol=0, msg=f"{rank} {name}")
        # o_proj's bias is added once, by rank 0: the others have none.
        only_first = {n for n in full if n.endswith("o_proj.bias")} if rank else set()
        assert set(full) - set(params) == only_first


# ----------------------------------------------------------------- loading (one process)


@pytest.mark.parametrize("kv_heads,vocab", [(2, 512), (1, 511)])
def test_random_preset_shards_are_slices_of_tp1_weights(kv_heads, vocab):
    cfg = replace(resolve_model("random:tiny").config, num_key_value_heads=kv_heads,
                  vocab_size=vocab)
    source = ModelSource("random:tiny", None, cfg)
    full = build_model(source, torch.float32, "cpu", max_positions=16, seed=3)
    check_shards(full, 2, lambda tp: build_model(source, torch.float32, "cpu",
                                                 max_positions=16, seed=3, tp=tp))


def test_sharded_safetensors_load_reads_only_the_slices(checkpoints):
    path = checkpoints["llama"]
    source = resolve_model(str(path))
    full = build_model(source, torch.float32, "cpu", max_positions=16)
    full_bytes = load_safetensors_weights(full, path)
    norms = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
    read = []

    def build_rank(tp):
        model = build_model(source, torch.float32, "cpu", max_positions=16, tp=tp)
        read.append(load_safetensors_weights(model, path))  # again, counting the bytes
        return model

    check_shards(full, 2, build_rank)
    # Each sharded tensor is read once across the two ranks, the norms by both, the
    # o_proj biases by rank 0 alone.
    assert sum(read) == full_bytes + norms
    assert max(read) < 0.6 * full_bytes


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("dest_dtype", [torch.float32, torch.bfloat16])
def test_reader_reads_row_and_column_slices(tmp_path, staged, dest_dtype):
    """Slices through both read paths; 20-byte chunks cut runs (staged: the CUDA path's
    chunking, run on CPU) and fall mid-run."""
    from safetensors.torch import save_file

    from llmfast.models.formats.safetensors_reader import SafetensorsFile, TensorReader
    from llmfast.models.sharding import ShardSlice

    full = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "t.safetensors"
    save_file({"w": full}, path)
    entry = SafetensorsFile.open(path).entries["w"]
    reader = TensorReader(torch.device("cpu"), chunk_bytes=20, staged=staged)
    with open(path, "rb") as f, reader:
        for shard in (ShardSlice(0, 1, 3), ShardSlice(1, 2, 4), ShardSlice(1, 6, 1)):
            want = full.narrow(shard.dim, shard.start, shard.size)
            dest = torch.full(want.shape, float("nan"), dtype=dest_dtype)
            before = reader.bytes_read
            reader.read(f.fileno(), entry, dest, shard)
            assert torch.equal(dest, want.to(dest_dtype)), shard
            assert reader.bytes_read - before == want.numel() * 4


def test_bf16_model_casts_float32_checkpoint_slices(checkpoints):
    """A column slice read through the cast path (checkpoint float32, model bf16)."""
    source = resolve_model(str(checkpoints["qwen3"]))
    full = build_model(source, torch.bfloat16, "cpu", max_positions=16)
    check_shards(full, 2, lambda tp: build_model(source, torch.bfloat16, "cpu",
                                                 max_positions=16, tp=tp))


@pytest.mark.parametrize("changes,world,what", [
    ({"num_attention_heads": 6, "num_key_value_heads": 2}, 4, "6 attention heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "3 KV heads"),
    ({"num_attention_heads": 12, "num_key_value_heads": 2}, 3,
     "not a multiple of the model's 2 KV heads"),
    ({"intermediate_size": 130}, 4, "intermediate size 130"),
])
def test_uneven_split_is_one_line_config_error(changes, world, what):
    cfg = replace(resolve_model("random:tiny").config, **changes)
    with pytest.raises(ConfigError, match=what) as err:
        cfg.check_tensor_parallel(world)
    assert "\n" not in str(err.value)
    with pytest.raises(LoadError, match=what):
        build_model(ModelSource("random:x", None, cfg), torch.float32, "cpu",
                    max_positions=16, tp=TensorParallelGroup(rank=0, world_size=world))


def test_engine_config_refuses_uneven_tensor_parallel_size():
    from llmfast.engine.args import EngineArgs

    args = EngineArgs(model="random:tiny", device="cpu", tensor_parallel_size=3,
                      distributed_executor_backend="mp")
    with pytest.raises(ConfigError, match="tensor-parallel size 3 does not divide the "
                                          "model's 4 attention heads"):
        engine_config(args)


# ----------------------------------------------------------------- two ranks


def test_tp2_matches_tp1(checkpoints):
    """Logits of a prefill and a decode step, and greedy tokens through the runner
    (chunked prefill, then decodes; one family with async scheduling), on both ranks."""
    cases = []
    for family, path in checkpoints.items():
        cases.append(("model_logits", (str(path), PROMPTS, NEXT_IDS)))
        cases.append(("runner_tokens", (str(path), PROMPTS, 5, False, family == "qwen2")))
    wants = assert_ranks_match_tp1(cases, run_ranks(run_cases, 2, cases))
    assert all(len(ids) == 5 for ids in wants[1].values())


class SplitKFp8(torch.nn.Module):
    """The oracle of an fp8 row-parallel projection over `world` ranks, in one process:
    K split in `world` column blocks, each quantized on its own (weight rows and
    activation rows scaled over the block, as a rank sees it), the partial products
    summed in rank order (the all-reduce)."""

    def __init__(self, layer, world: int) -> None:
        super().__init__()
        k = layer.in_features // world
        self.blocks = torch.nn.ModuleList()
        for r in range(world):
            part = Linear(k, layer.out_features, bias=False)
            part.weight = torch.nn.Parameter(layer.weight[:, r * k:(r + 1) * k].clone())
            self.blocks.append(Fp8Linear.from_linear(part))
        self.bias = layer.bias
        self.k = k

    def forward(self, x):
        out = sum(b(x[:, i * self.k:(i + 1) * self.k]) for i, b in enumerate(self.blocks))
        return out if self.bias is None else out + self.bias


def fp8_split_k_oracle(spec: str, world: int):
    """TP=1's model with fp8 projections quantized as `world` ranks quantize them:
    column-parallel ones (qkv, gate_up) keep every row's whole K, so TP=1's per-row
    scales; row-parallel ones (o, down) per K block."""
    model = build_model(resolve_model(spec), torch.float32, "cpu", max_positions=128, seed=0)
    for layer in model.model.layers:
        layer.self_attn.o_proj = SplitKFp8(layer.self_attn.o_proj, world)
        layer.mlp.down_proj = SplitKFp8(layer.mlp.down_proj, world)
    quantize_fp8(model)  # the rest
    return model


def test_tp2_fp8_matches_split_k_oracle(checkpoints):
    """--quantization fp8 on two ranks quantizes each rank's shards (as vLLM): logits
    as the split-K oracle's, and greedy tokens through the runner as TP=1 with that
    oracle's quantization would give."""
    path = str(checkpoints["llama"])
    want = paged_logits(fp8_split_k_oracle(path, 2), PROMPTS, NEXT_IDS)
    cases = [("model_logits", (path, PROMPTS, NEXT_IDS, "fp8")),
             ("runner_tokens", (path, PROMPTS, 5, False, False, None, "cpu", "fp8"))]
    rank_results = run_ranks(run_cases, 2, cases)
    for rank_logits, _ in rank_results:
        np.testing.assert_allclose(rank_logits, want, rtol=0, atol=2e-4)
    # TP=1 fp8 quantizes o and down over the whole K: a different model by fp8 rounding.
    tp1 = model_logits(SINGLE, path, PROMPTS, NEXT_IDS, "fp8")
    assert np.abs(tp1 - want).max() > 10 * 2e-4
    # Greedy decode from the oracle's logits (rank 0's tokens) agrees on the first token.
    tokens = rank_results[0][1]
    first_rows = np.cumsum([len(p) for p in PROMPTS]) - 1
    assert [ids[0] for ids in tokens.values()] == list(want[first_rows].argmax(-1))


def test_tp2_compiled_trace_matches_tp1(checkpoints):
    """torch.compile with the piecewise backend (pieces as FX code): one graph per rank,
    with the collectives inside it, equal to TP=1 eager."""
    path = str(checkpoints["llama"])
    want = model_logits(SINGLE, path, PROMPTS, NEXT_IDS)
    for got in run_ranks(run_cases, 2, [("compiled_logits", (path, PROMPTS, NEXT_IDS))]):
        np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5)


@pytest.mark.slow
def test_tp2_inductor_runner_matches_tp1(checkpoints, tmp_path):
    """The runner compiled with Inductor on each rank (~60 s on 2 cores)."""
    path = str(checkpoints["qwen2"])
    want = runner_tokens(SINGLE, path, PROMPTS, 5)
    got = run_ranks(runner_tokens, 2, path, PROMPTS, 5, True, False, str(tmp_path))
    assert got[0] == want


@pytest.mark.gpu
def test_tp2_cuda_graphs_match_tp1(checkpoints, tmp_path):
    """NCCL, compiled, full and piecewise CUDA graphs captured on both ranks, async
    scheduling: the same greedy tokens as TP=1 on one GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism on CUDA needs 2 GPUs")
    path = str(checkpoints["llama"])
    want = runner_tokens(SINGLE, path, PROMPTS, 5, True, True, str(tmp_path), "cuda")
    got = run_ranks(runner_tokens, 2, path, PROMPTS, 5, True, True, str(tmp_path), "cuda",
                    device_type="cuda")
    assert got[0] == want
