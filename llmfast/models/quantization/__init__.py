"""Weight quantization applied after loading (`--quantization`): see fp8.py."""
