"""The runner's start-up, in its order on CUDA: the Triton variants compiled in threads
(`kernel_precompile`), the largest step's memory measured (`memory_profile`) and the
CUDA graphs' estimated (`graph_memory`), the KV cache sized and allocated from what is
left (`kv_cache_sizing`), the model compiled and its CUDA graphs captured once on that
cache (`graph_capture`). `runner_startup` runs them in that order for the runner."""
