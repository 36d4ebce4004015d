"""Checkpoint file formats: our safetensors reader (whole tensors or a rank's slices) and
the GGUF conversion to an HF-style directory."""
