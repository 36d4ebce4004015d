"""Benchmarks of `llmfast serve`: the OpenAI-client load generator and the comparison of a
server's figures with the offline engine's on the same workload."""
