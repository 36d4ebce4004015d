"""CUDA graphs for the compiled model's pieces: capture sizes, padding, capture/replay."""
