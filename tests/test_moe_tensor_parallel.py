"""Tensor parallelism of the mixtures of experts on CPU (gloo): each rank holds every
expert with its slice of their intermediate columns (models/sharding.py), the router
whole; TP=2 computes what TP=1 computes. The split's oracle is written here from the
column ranges (not from the loader's mapping), as tests/test_tensor_parallel.py's is."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmfast.config import ConfigError
from llmfast.distributed import TensorParallelGroup
from llmfast.models.loading.checkpoint_weights import load_safetensors_weights
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import ModelSource, resolve_model
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.ranks import run_ranks
from tests.helpers.tp_runs import assert_ranks_match_tp1, run_cases
from tests.test_tensor_parallel import NEXT_IDS, PROMPTS, expected_shard


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_moe")
    return {family: make_hf_checkpoint(root / family, family=family)
            for family in ("qwen3_moe", "mixtral")}


def expected_moe_shard(name: str, full: torch.Tensor, cfg, rank: int,
                       world: int) -> torch.Tensor:
    inter, experts = cfg.moe_intermediate_size, cfg.num_experts
    cols = list(range(rank * inter // world, (rank + 1) * inter // world))
    if name.endswith("experts.gate_up_weight"):  # [E * 2I, H]: per expert gate, then up rows
        return full[[e * 2 * inter + half * inter + c
                     for e in range(experts) for half in (0, 1) for c in cols]]
    if name.endswith("experts.down_weight"):  # [E * H, I]: columns
        return full[:, cols]
    return expected_shard(name, full, cfg, rank, world)  # the router: whole, as a norm


def check_moe_shards(full_model, world: int, build_rank) -> None:
    full = dict(full_model.named_parameters())
    assert any(n.endswith("experts.gate_up_weight") for n in full)
    for rank in range(world):
        params = dict(build_rank(TensorParallelGroup(rank=rank, world_size=world))
                      .named_parameters())
        assert set(params) == set(full)
        for name, param in params.items():
            want = expected_moe_shard(name, full[name], full_model.config, rank, world)
            assert param.shape == want.shape, (rank, name)
            torch.testing.assert_close(param, want, rtol=0, atol=0, msg=f"{rank} {name}")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_checkpoint_shards_are_slices_of_tp1_weights(checkpoints, family):
    path = checkpoints[family]
    source = resolve_model(str(path))
    full = build_model(source, torch.float32, "cpu", max_positions=16)

    def build_rank(tp):
        model = build_model(source, torch.float32, "cpu", max_positions=16, tp=tp)
        load_safetensors_weights(model, path)
        return model

    check_moe_shards(full, 2, build_rank)


def test_random_weights_shards_are_slices_of_tp1_weights(checkpoints):
    """A random preset's ranks draw TP=1's tensors and keep their slices (here the tiny
    Qwen3-MoE's config as a preset)."""
    source = ModelSource("random:moe", None, resolve_model(str(checkpoints["qwen3_moe"])).config)
    full = build_model(source, torch.float32, "cpu", max_positions=16, seed=5)
    check_moe_shards(full, 2, lambda tp: build_model(source, torch.float32, "cpu",
                                                     max_positions=16, seed=5, tp=tp))


def test_uneven_expert_split_refused(checkpoints):
    cfg = replace(resolve_model(str(checkpoints["mixtral"])).config, moe_intermediate_size=50)
    with pytest.raises(ConfigError, match="experts' intermediate size 50"):
        cfg.check_tensor_parallel(4)


def test_tp2_matches_tp1(checkpoints):
    """Logits of a prefill and a decode step, and greedy tokens through the runner, on
    both ranks (one all-reduce of the experts' partial sums per sparse layer)."""
    cases = []
    for path in checkpoints.values():
        cases.append(("model_logits", (str(path), PROMPTS, NEXT_IDS)))
        cases.append(("runner_tokens", (str(path), PROMPTS, 5)))
    assert_ranks_match_tp1(cases, run_ranks(run_cases, 2, cases))
