"""Start-up, cold and warm, each in a fresh process: `runs` starts the two processes and
reads their figures, `child` is the process (`python -m llmfast.bench.startup.child`).

Imports nothing, so that `-m` finds `child` not yet imported; `run_startup` is in `runs`.
"""
