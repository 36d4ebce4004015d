"""The Triton attention backend (CUDA, and the CPU under Triton's interpreter); see
`llmfast.attention`. Importing it imports Triton: `attention/ops.py` does so at the
first Triton call only."""
