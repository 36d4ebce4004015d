"""The decoder's per-layer ops besides attention and the projections: RMSNorm (with the
residual add) and rotary embedding, each one Triton kernel on CUDA and torch ops on CPU.

- `rms_norm.py`, `rotary.py`: what the model calls (eager: directly; compiled: through
  the triton ops of `triton_ops.py`, which Inductor launches from its pieces);
- `triton_kernels.py`: the Triton kernels (imports Triton; loaded on first use);
- `kernel_choice.py`: `LLMFAST_LAYER_KERNELS=0` selects the torch ops everywhere.
"""
