"""`llmfast serve`: an OpenAI-compatible HTTP front on the same engine.

`engine_loop` owns the engine (one thread steps it while any request is live); `app`
holds the FastAPI routes; `protocol` the request models (OpenAI field names);
`responses` turns engine deltas into OpenAI JSON; `errors`, `sse`, `metrics` and `server`
(uvicorn with a clean SIGTERM) are the rest.
"""
