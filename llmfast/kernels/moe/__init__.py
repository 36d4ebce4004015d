"""The mixture-of-experts layer's kernels: routing (`routing`), the experts' SwiGLU MLPs
for every (token, expert) pair the router picked as one op (`ops`), computed by grouped
Triton GEMMs on CUDA (`triton_moe`, tiles from `tile_table`) and by a per-expert torch
loop on CPU (`torch_moe`)."""
