"""Skinny GEMM (GEMV) kernels for decode-sized batches: ops.py (the op the layers call),
launch_config.py (cuBLAS or Triton, and the launch configuration, per shape and GPU),
triton_kernels.py (the kernels)."""
