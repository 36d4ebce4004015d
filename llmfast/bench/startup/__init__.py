"""Start-up, cold and warm, each in a fresh process: `runs` starts the two processes and
reads their figures; the process itself is `python -m llmfast.cli.startup_child` (it
builds an `LLM`, which sits above this package: only its module name is known here).

Imports nothing, so that `-m` finds its modules not yet imported; `run_startup` is in
`runs`.
"""
