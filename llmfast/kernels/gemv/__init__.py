"""Skinny GEMM (GEMV) kernels for decode-sized batches: ops.py (the op the layers call),
launch_config.py (cuBLAS or Triton, and the launch configuration, per shape and GPU),
worker/startup/gemv_tuning.py (--gemv auto's measurement at start-up where no table knows a shape),
triton_kernels.py (the kernels). Which layers call the op: worker/startup/gemv_routing.py."""
