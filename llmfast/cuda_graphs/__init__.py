"""CUDA graphs (captured device work, not FX graphs), apart from the compile backend:

- `model_graphs.py`: `ModelCudaGraphs`, one model's graphs: the piece wrapper it hands
  the compile backend, the full graphs, the dispatcher, and their one capture;
- `dispatch.py`: which graph a step replays (full, piecewise or none) and its padding;
- `piecewise.py`: one graph per (compiled piece, size), attention eager between them;
- `full.py`: one graph of the whole forward per uniform-decode size;
- `capturers.py`: real CUDA graphs, or their CPU stand-in for tests;
- `sizes.py`: capture sizes and padding; `capture_context.py`: the side stream and GC
  freeze captures run under; `stats.py`: what capturing did.
"""
