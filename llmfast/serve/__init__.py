"""`llmfast serve`: an OpenAI-compatible HTTP server over the engine.

`api/` is the HTTP API itself (FastAPI routes, OpenAI request models and errors, JSON and
SSE responses, /metrics), written against `stream.EngineFront`. The rest wires it to the
engine: `engine_loop` owns the engine and steps it while any request is live; `server`
runs uvicorn either in the engine's process (the loop on a thread: `AsyncEngine`) or, with
`--api-servers N`, in N processes of their own (`api_process`, each over an
`engine_client.EngineClient`) while `engine_host` runs the loop alone in the main process.
`stream` holds what crosses between the two sides.
"""
