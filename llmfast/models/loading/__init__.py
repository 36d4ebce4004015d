"""Weights into a model: `build_model` (check on the meta device, allocate on the target
device, fill), checkpoint streaming into (fused, sharded) parameters, seeded random
weights for presets, config/checkpoint validation, load errors and progress."""
