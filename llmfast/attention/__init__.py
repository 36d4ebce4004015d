"""Attention: everything a reader opens to understand it, in one folder.

- `metadata.py`: `AttentionMetadata`, the per-step tensors the runner threads into
  `forward` (slot_mapping, block_table, query_start_loc, seq_lens, max_query_len).
- `ops.py`: the custom ops `llmfast::unified_attention` and `llmfast::reshape_and_cache`
  (what the model calls and the compile backend splits at), their torch reference
  implementations (the tests' oracle) and the dispatch to a backend.
- `cpu.py`: the CPU backend (vectorised torch over the paged cache).
- `triton/`: the Triton backend: `launch.py` (the cached launch, prefill-tile tuning
  at start-up), `launch_plan.py` (what a launch derives from its shapes),
  `launch_config.py` (tiles and KV splits from host-known shapes), `kernels.py` (the
  kernels and their design), `kv_write.py` and `rope_cache.py` (the KV write, with the
  rotary embedding fused in on CUDA).
- `workspaces.py`: the kernels' scratch (split partials, arrival counters, CPU plans),
  owned by the runner that owns the KV cache.
- `tuning/`: measured launch choices per GPU model (KV-split and prefill-tile tables,
  shipped in the package and tuned once into a cache on disk).

Below it, `llmfast.kernels` holds what attention shares with the layers: the cached
Triton launcher and start-up precompile (`kernels/launch/`) and the rotary helpers.
"""
