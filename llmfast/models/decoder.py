"""The decoder of every family llmfast runs (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3), in
plain torch: fused qkv and gate_up projections, GQA, RoPE, RMSNorm. The families differ
only by `ModelConfig` options: q/k/v and o_proj biases, per-head q/k RMSNorm, tied
embeddings, rope scaling, per-layer sliding windows, Gemma's layer shape
(models/sandwich_layer.py) and GeGLU (models/families.py says which family has which). A
mixture of experts (Qwen3-MoE, Mixtral) swaps the MLP of its sparse layers for
models/sparse_moe.py's.

Inputs are flat over the step's tokens (no batch dimension): requests are told apart
only by the attention metadata. Attention goes through `torch.ops.llmfast.unified_attention`,
which also writes the new tokens' keys and values into the paged KV cache.

Tensor parallelism (`tp`, passed down from the runner): each rank builds the layers of
its shard (models/sharding.py: heads, KV heads, MLP columns, vocabulary rows), and the
row-parallel projections and the embedding all-reduce (models/parallel_layers.py). One
rank builds exactly the single-device layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmfast.attention.cpu import paged_attention_cpu
from llmfast.attention.cpu_step import CpuStepState
from llmfast.attention.metadata import AttentionMetadata
from llmfast.attention.ops import (  # also registers torch.ops.llmfast.*
    reshape_and_cache_reference,
    unified_attention_impl,
)
from llmfast.config import ModelConfig, RopeScaling
from llmfast.core.kv_cache_groups import kv_cache_groups
from llmfast.distributed import TensorParallelGroup
from llmfast.kernels.cpu.linear import MAX_SPLIT_TOKENS_LM_HEAD, Linear
from llmfast.kernels.layers.rms_norm import add_rms_norm_impl, rms_norm_impl
from llmfast.kernels.layers.rotary import rope_fuses_into_attention
from llmfast.kernels.layers.rotary_reference import rotate
from llmfast.models.cpu_layer import cpu_layer_forward
from llmfast.models.fused_layer import fusable, fused_layer_forward
from llmfast.models.parallel_layers import (
    gather_logits,
    row_parallel_linear,
    vocab_parallel_embedding,
)
from llmfast.models.rope import RotaryEmbedding
from llmfast.models.sandwich_layer import SandwichDecoderLayer
from llmfast.models.sharding import rank_model_config, vocab_shard
from llmfast.models.sparse_moe import SparseMoeBlock


class RMSNorm(nn.Module):
    """weight * rms_norm(x), or with `residual`: (weight * rms_norm(x + residual),
    x + residual). One Triton kernel on CUDA (kernels/layers/rms_norm.py), HF's numerics.
    `offset` (Gemma): the weight is stored as an offset from 1, the norm scales by
    (1 + weight), in float32, rounded once."""

    def __init__(self, size: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # Compiled graphs record the op (Inductor launches its kernel); eager calls skip
        # the op's dispatcher, which costs more than a small norm on CPU.
        compiling = torch.compiler.is_compiling()
        if residual is None:
            norm = torch.ops.llmfast.rms_norm if compiling else rms_norm_impl
            return norm(x, self.weight, self.eps, self.offset)
        add_norm = torch.ops.llmfast.add_rms_norm if compiling else add_rms_norm_impl
        return add_norm(x, residual, self.weight, self.eps, self.offset)


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    """The family's RMSNorm: weight * norm, or Gemma's (1 + weight) * norm."""
    return RMSNorm(size, config.rms_norm_eps, config.norm_offset)


class Attention(nn.Module):
    """`config`: this rank's view (its heads; see models/sharding.py). `window`: this
    layer's sliding window (None: global attention). `kv_group`: this layer's KV-cache
    group where the model has several (core/kv_cache_groups.py): it reads that group's
    slot mapping and block table from the metadata; None: the metadata's only ones."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 tp: TensorParallelGroup, window: int | None = None,
                 kv_group: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.kv_group = kv_group
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, config.o_bias, tp)
        # Qwen3: each query and key head RMS-normalised over head_dim before RoPE.
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.rotary = rotary
        # Set by `DecoderForCausalLM.bind_kv_caches`; views into the runner's cache tensor.
        # [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        return self.o_proj(self.attend(positions, qkv, attn_metadata))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               attn_metadata: AttentionMetadata) -> torch.Tensor:
        """qkv [num_tokens, q_size + 2 * kv_size] -> the heads' outputs [num_tokens,
        q_size], before o_proj (which the fused layer applies with its residual add)."""
        qk, v = self._heads(qkv)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        cos_sin = self.rotary.cos_sin
        if rope_fuses_into_attention(q, k, v, cos_sin, self.k_cache, self.v_cache):
            # The op rotates q and k in its KV write (attention/triton/rope_cache.py): one kernel
            # a layer fewer than rotating here.
            rope_args = (positions, cos_sin, attn_metadata.max_query_len)
        else:
            qk = self.rotary(positions, qk)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            rope_args = ()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # Compiled graphs record the custom op (the backend splits there); eager calls
        # skip its dispatcher, which costs more than the CPU attention itself at batch 1.
        attention = (
            torch.ops.llmfast.unified_attention
            if torch.compiler.is_compiling()
            else unified_attention_impl
        )
        slot_mapping, block_table = self._tables(attn_metadata)
        attention(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            slot_mapping,
            block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            out,
            *rope_args,
            window=self.window,
        )
        return out.view(-1, self.q_size)

    def attend_cpu(self, positions: torch.Tensor, qkv: torch.Tensor,
                   attn_metadata: AttentionMetadata, step: CpuStepState) -> torch.Tensor:
        """`attend` on the eager torch path (no Triton: the CPU), with the work every
        layer of the step shares looked up in the step's memo (attention/cpu_step.py):
        the rotary rows, the padding flag, the attention plan. The same values as
        `attend` (tests/test_cpu_step.py)."""
        qk, v = self._heads(qkv)
        rotary = self.rotary
        qk = rotate(qk, *step.rope(positions, rotary.cos_sin, rotary.rotate_sign))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        slot_mapping, block_table = self._tables(attn_metadata)
        k_cache, v_cache = self.k_cache, self.v_cache
        query_start_loc, seq_lens = attn_metadata.query_start_loc, attn_metadata.seq_lens
        reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping,
                                    step.has_padding(slot_mapping))
        out = torch.empty(q.shape, dtype=q.dtype)
        paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                            self.scale, out, self.window,
                            step.plan(k_cache, block_table, query_start_loc, seq_lens,
                                      self.window))
        return out.view(-1, self.q_size)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv -> (queries and keys [T, heads + kv_heads, head_dim] (q/k-normed where the
        family norms them), values [T, kv_heads, head_dim])."""
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Queries and keys are adjacent columns: rotate them as one [T, heads + kv_heads, d].
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        return qk, v.view(-1, self.num_kv_heads, self.head_dim)

    def _tables(self, attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's KV-cache group's (slot_mapping, block_table)."""
        if self.kv_group is None:
            return attn_metadata.slot_mapping, attn_metadata.block_table
        return (attn_metadata.group_slot_mappings[self.kv_group],
                attn_metadata.group_block_tables[self.kv_group])


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = row_parallel_linear(config.intermediate_size, config.hidden_size,
                                             False, tp)
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 tp: TensorParallelGroup, layer: int = 0, kv_group: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary, tp, config.layer_window(layer), kv_group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (SparseMoeBlock(config, tp) if config.is_sparse_layer(layer)
                    else MLP(config, tp))

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds
        the two (with the norm, in one kernel) instead of a separate add."""
        if residual is None:  # the first layer: the embeddings are the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """`config`: this rank's view (see `DecoderForCausalLM`)."""

    def __init__(self, config: ModelConfig, max_positions: int,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        vocab_start, _, vocab_rows = vocab_shard(config.vocab_size, tp)
        self.embed_tokens = vocab_parallel_embedding(vocab_rows, config.hidden_size,
                                                     vocab_start, tp)
        rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        # Gemma 3: the sliding layers rotate with a base of their own, unscaled.
        local_rotary = rotary if config.rope_local_theta is None else RotaryEmbedding(
            config.head_dim, max_positions, config.rope_local_theta, RopeScaling())

        # Each layer's KV-cache group, where the model has several (global and sliding
        # layers): its attention reads that group's tables.
        groups = kv_cache_groups(config)
        layer_group = groups.layer_group() if groups.num_groups > 1 else None

        def layer(i: int) -> nn.Module:
            window = config.layer_window(i)
            layer_rotary = rotary if window is None else local_rotary
            kv_group = None if layer_group is None else layer_group[i]
            if not config.sandwich_norms:
                return DecoderLayer(config, layer_rotary, tp, i, kv_group)
            return SandwichDecoderLayer(lambda: make_norm(config, config.hidden_size),
                                        Attention(config, layer_rotary, tp, window, kv_group),
                                        MLP(config, tp))

        self.layers = nn.ModuleList(layer(i) for i in range(config.num_hidden_layers))
        # Eager CPU steps run models/cpu_layer.py's layer (Gemma's sandwich layers: their
        # own forward).
        self.cpu_layers = len(self.layers) > 0 and all(type(layer) is DecoderLayer
                                                       for layer in self.layers)
        # Decode-sized steps with the projections' neighbours fused (models/fused_layer.py):
        # `gemv_fused` the --gemv backend they run on when --gemv-fuse routed them
        # there at start-up (worker/startup/gemv_routing.py), "" for the plain layers.
        self.fusable = fusable(config, tp.world_size)
        self.gemv_fused = ""
        self.norm = make_norm(config, config.hidden_size)
        # Gemma: embeddings times sqrt(hidden_size), that factor rounded to the
        # embeddings' dtype (the model is built in its dtype: loading/loader.py) first,
        # as HF does: in bf16 sqrt(3072) = 55.43 becomes 55.5. A Python number, so the
        # multiply reads no tensor.
        self.embed_scale = None
        if config.embed_scale:
            self.embed_scale = float(torch.tensor(config.hidden_size**0.5, device="cpu")
                                     .to(torch.get_default_dtype()))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.gemv_fused:
            residual = hidden  # [num_tokens, hidden_size]: the stream, sums included
            for layer in self.layers:
                residual = fused_layer_forward(layer, positions, residual, attn_metadata,
                                               self.gemv_fused)
            return self.norm(residual)
        residual = None
        # The eager torch path's per-step memo (attention/cpu_step.py); compiled graphs
        # never read it.
        step = None if torch.compiler.is_compiling() else attn_metadata.cpu_step
        if step is not None and self.cpu_layers:
            for layer in self.layers:
                hidden, residual = cpu_layer_forward(layer, positions, hidden, residual,
                                                     attn_metadata, step)
            # add_rms_norm's sum, made here: a packed last layer's output is bfloat16.
            return self.norm(hidden + residual)
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class DecoderForCausalLM(nn.Module):
    """`tp`: this rank's place in tensor parallelism (default: one rank). The layers are
    built from `rank_config`, the per-rank view of `config` (this rank's heads, KV heads
    and MLP columns: also what its KV cache holds); the embedding and lm_head hold this
    rank's vocabulary rows. See models/sharding.py."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallelGroup.single()
        self.rank_config = rank_model_config(config, self.tp.world_size)
        # The layers' KV-cache groups and page layout (core/kv_cache_groups.py).
        self.kv_groups = kv_cache_groups(self.rank_config)
        self.model = DecoderModel(self.rank_config,
                                  max_positions or config.max_position_embeddings, self.tp)
        self.lm_head = Linear(
            config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False,
            max_split_tokens=MAX_SPLIT_TOKENS_LM_HEAD,
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size] final hidden states."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] selected hidden states -> [n, vocab_size] logits in the
        model's dtype, rounded as HF's are. Not float32 here: a greedy step's argmax
        reads them as they are (a float32 copy was a kernel of 22 µs a step at batch 64
        on an H200, 4 bytes a logit written and read again), and the sampler makes the
        copy where it computes more (sampling/sampler.py)."""
        logits = self.lm_head(hidden)  # [n, vocab rows of this rank]
        if self.tp.world_size > 1:
            logits = gather_logits(logits, self.config.vocab_size, self.tp)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give each attention layer its (k_cache, v_cache), once, before compiling."""
        layers = self.attention_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} layers")
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            layer.k_cache, layer.v_cache = k_cache, v_cache
