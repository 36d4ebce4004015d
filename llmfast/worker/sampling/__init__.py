"""Sampling on the device without a host sync: the sampler's stages, its per-step
metadata built from the persistent batch, and sampling under tensor parallelism."""
