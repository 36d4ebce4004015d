"""Device-level benchmarks: the attention kernels' decode and prefill cases, their launch
configurations, GEMV/MoE/sliding helpers' CUDA timing, and a decode step's time per layer
kind against the HBM limit. Used by scripts/ and `scripts/gpu_check.py`."""
