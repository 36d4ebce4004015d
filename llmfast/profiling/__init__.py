"""Per-phase timing of engine steps: NVTX ranges for nsys, host and CUDA-event times
for the `profile` table."""
