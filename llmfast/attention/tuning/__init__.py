"""Measured launch choices per GPU model: KV-split counts for decode and prefill tile
configurations, each with the tables shipped in the package and a tuned cache on disk."""
