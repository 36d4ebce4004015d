"""The `random:<preset>` models: the shapes of real checkpoints (Llama, Qwen, Mistral, Gemma,
and the mixtures of experts Qwen3-30B-A3B and Mixtral-8x7B)
for dummy weights, so speed and memory can be measured without downloading anything."""

from __future__ import annotations

from llmfast.config import ModelConfig, RopeScaling
from llmfast.models.families import family_config


def _llama3(factor: float) -> RopeScaling:
    return RopeScaling("llama3", factor, 1.0, 4.0, 8192)


def _gemma3(num_layers: int, window: int, **fields) -> ModelConfig:
    """Gemma 3's text decoder: five sliding layers to one global, GeGLU, head_dim 256."""
    layer_types = tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                        for i in range(num_layers))
    return family_config(
        "Gemma3ForCausalLM", num_hidden_layers=num_layers, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_theta=10000.0, query_pre_attn_scalar=256.0,
        hidden_act="gelu_pytorch_tanh", sliding_window=window, layer_types=layer_types,
        tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(1, 106), **fields)


RANDOM_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=4096,
        eos_token_ids=(2,), bos_token_id=1,
    ),
    "smollm2-135m": ModelConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
        tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=_llama3(32.0), tie_word_embeddings=True, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-3b": ModelConfig(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=_llama3(32.0), tie_word_embeddings=True, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
        rope_scaling=_llama3(8.0), max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen2.5-0.5b": family_config(
        "Qwen2ForCausalLM",
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        head_dim=64, intermediate_size=4864, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
    "qwen3-0.6b": family_config(
        "Qwen3ForCausalLM",
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960,
        bos_token_id=151643, eos_token_ids=(151645, 151643),
    ),
    "qwen3-8b": family_config(
        "Qwen3ForCausalLM",
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
    # Mistral-7B v0.3's shapes: no sliding window since v0.2, 32768 tokens.
    "mistral-7b": family_config(
        "MistralForCausalLM",
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=32768, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,),
    ),
    # Gemma 3's text decoders (the 4B's: its vision tower aside).
    "gemma-3-1b": _gemma3(
        26, 512, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768,
    ),
    "gemma-3-4b": _gemma3(
        34, 1024, hidden_size=2560, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=10240, vocab_size=262208, max_position_embeddings=131072,
        rope_scaling=RopeScaling("linear", 8.0),
    ),
    # Qwen3-30B-A3B: 128 experts of 768 columns, 8 per token (3.3B of 30.5B active).
    "qwen3-30b-a3b": family_config(
        "Qwen3MoeForCausalLM",
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, vocab_size=151936, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, bos_token_id=151643,
        eos_token_ids=(151645, 151643), num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True,
    ),
    # Mixtral-8x7B v0.1: 8 experts of 14336 columns, 2 per token (12.9B of 46.7B active).
    "mixtral-8x7b": family_config(
        "MixtralForCausalLM",
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, vocab_size=32000, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
    ),
}
