"""The runner's start-up, in its order on CUDA: the Triton variants compiled in threads
(`kernel_precompile`), the largest step's memory measured (`memory_profile`), the model
compiled and its CUDA graphs captured (`graph_capture`), the KV cache sized and allocated
from what is left (`kv_cache_sizing`)."""
