"""The grammar side of structured outputs (xgrammar): a constraint made into a grammar
and checked (`grammars`), grammars compiled against the model's vocabulary off the
step's path and cached (`compiler`). The per-step token bitmask lives with the sampler
(llmfast/worker/sampling/grammar_bitmask.py)."""
