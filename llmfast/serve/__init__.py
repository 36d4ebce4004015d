"""`llmfast serve`: an OpenAI-compatible HTTP server over the engine core's process.

`api/` is the HTTP API itself (FastAPI routes, OpenAI request models and errors, JSON and
SSE responses, /metrics), written against `frontend_types.EngineFront`. `frontend.Frontend` is
that front: it owns the tokenizer (prompts tokenized on `prompt_preparer`'s threads,
checked by the engine's input processor, outputs detokenized by its output processor)
and talks to the engine core's process (llmfast/engine/core_process.py) over ZeroMQ.
`server` starts it all; `launcher` is the main process (the core's process, then the
frontend here or in N `api_process`es, watched). `frontend_types` holds what crosses between
the HTTP handlers and the frontend.
"""
